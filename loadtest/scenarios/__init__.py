"""Scenario scripts: each starts the processes it needs, runs bench loads, prints a table."""
