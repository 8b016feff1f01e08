"""vLLM ``general_plugins`` entry point: runs once in every vLLM process."""

from __future__ import annotations

from typing import Any

from composer.export import CONNECTOR_NAME as CONNECTOR
from composer.vllm.handoff import install


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR, "composer.vllm.connector", "ComposedConnector"  # the class
        )
    _route_hma_question(KVConnectorFactory)

    install()


def _route_hma_question(factory: Any) -> None:
    """vLLM decides whether to keep its hybrid KV cache manager from
    ``KVConnectorFactory.supports_hma_config``, which looks through MultiConnector
    to its children by name; ComposedConnector gets the same: HMA only if every node
    supports it (``ComposedConnector.all_nodes_support_hma``)."""
    original = factory.supports_hma_config
    if getattr(original, "kvc_routed", False):
        return

    def supports_hma_config(kv_transfer_config: Any) -> bool:
        if kv_transfer_config.kv_connector == CONNECTOR:
            connector_cls = factory.get_connector_class(kv_transfer_config)
            ask = getattr(connector_cls, "all_nodes_support_hma", None)
            if ask is not None:
                return bool(ask(kv_transfer_config))
        return bool(original(kv_transfer_config))

    supports_hma_config.kvc_routed = True  # type: ignore[attr-defined]
    factory.supports_hma_config = staticmethod(supports_hma_config)
