"""The scheduler process: admission, routing, worker registry."""
