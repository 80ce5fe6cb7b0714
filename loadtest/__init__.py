"""Load generator and reports for OpenAI-compatible servers (`tison bench`); benchmarks."""
