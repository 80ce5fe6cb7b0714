"""The gateway process: OpenAI-compatible HTTP in front of the NATS control plane."""
