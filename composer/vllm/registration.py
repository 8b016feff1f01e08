"""vLLM ``general_plugins`` entry point: runs once in every vLLM process."""

from __future__ import annotations

CONNECTOR = "ComposedConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR, "composer.vllm.connector", "ComposedConnector"
        )
    from composer.vllm.handoff import install

    install()
