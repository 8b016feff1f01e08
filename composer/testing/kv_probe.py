"""A vLLM worker extension for tests of running servers: acts on the worker's KV cache.

``vllm serve --worker-extension-cls composer.testing.kv_probe.KVProbe`` adds
its methods to every worker; with ``VLLM_SERVER_DEV_MODE=1`` the server's
``POST /collective_rpc`` calls them by name (arguments travel as strings), so a
test can overwrite a running prefill engine's KV after its prefill and see
whether the decode engine's tokens change: whether the bytes really came over.
"""

from __future__ import annotations

from typing import Any


class KVProbe:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    model_runner: Any

    def overwrite_kv(self, value: str = "0") -> int:
        """Fill every KV cache tensor with ``float(value)``; the elements written."""
        count = 0
        for cache in self.model_runner.kv_caches:
            cache.fill_(float(value))
            count += cache.numel()
        return count
