"""The vLLM side of KV Composer: imports vLLM and torch (never imported by ``import composer``)."""
