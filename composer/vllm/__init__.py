"""The vLLM side of KV Composer: imports vLLM and torch (never imported by ``import composer``)."""

from composer.vllm.native import NativeConnectorNode

__all__ = ["NativeConnectorNode"]
