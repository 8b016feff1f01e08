"""A model's KV cache groups and slot sizes, read from its ``config.json`` (no torch, no vLLM)."""
