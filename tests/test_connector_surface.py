"""The composed connector overrides the whole KVConnectorBase_V1 surface of the installed vLLM."""

from __future__ import annotations

import inspect

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from composer.hookspecs import NodeSpec
from composer.vllm.connector import ComposedConnector


def public_members(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_every_public_member_of_the_base_class_is_overridden() -> None:
    missing = sorted(
        name
        for name in public_members(KVConnectorBase_V1)
        if name not in ComposedConnector.__dict__
    )
    assert missing == [], f"ComposedConnector does not override: {missing}"


def test_supports_hma_and_is_concrete() -> None:
    assert issubclass(ComposedConnector, SupportsHMA)
    assert not inspect.isabstract(ComposedConnector)


def test_every_base_class_method_has_a_hook_or_is_composer_level() -> None:
    hooks = {name for name in dir(NodeSpec) if not name.startswith("_")}
    # Methods that the composer answers itself rather than asking nodes.
    composer_level = {
        "role",
        "has_connector_metadata",
        "get_finished",  # answered from get_transfer_results, as MultiConnector does
        "get_required_kvcache_layout",
        "requires_piecewise_for_cudagraph",
        "build_kv_connector_stats",
        "build_prom_metrics",
        "supports_divergent_local_hybrid_hits",
        "requires_kv_delivery",
    }
    uncovered = sorted(public_members(KVConnectorBase_V1) - hooks - composer_level)
    assert uncovered == [], f"base-class methods with no lifecycle hook: {uncovered}"
