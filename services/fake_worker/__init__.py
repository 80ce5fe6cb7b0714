"""A fake prefill/decode worker speaking the real protocol, with deterministic tokens."""
