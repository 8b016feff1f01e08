"""Helpers to run real vLLM on a tiny local model (tests, the demo, benchmarks)."""
