"""Adapts vLLM's ``tests/v1/kv_connector/unit/test_hma_auto_config.py`` to ComposedConnector.

What vLLM's file checks: with no preference given, ``VllmConfig`` keeps the
hybrid KV cache manager (HMA) on for a connector that implements
``SupportsHMA`` and switches it off for one that does not; for a
MultiConnector, on only if every child supports HMA
(``KVConnectorFactory.supports_hma_config`` ->
``MultiConnector.all_children_support_hma``); and the factory refuses a
non-HMA connector when HMA was asked for explicitly. Its fixture makes the
platform claim HMA support, as vLLM's GPU platform does.

Adapted, as :mod:`multi_connector_adapter` adapts ``test_multi_connector.py``
(same loading, same per-release match counts): each MultiConnector
``KVTransferConfig`` of the file is built as vLLM's file builds it and then
translated to a ComposedConnector config whose pipeline runs the same children
as ``vllm`` nodes, in order (``composer.testing.multiconnector``). vLLM then
asks the same factory question, which KV Composer's vLLM plugin routes to
``ComposedConnector.all_nodes_support_hma`` (``composer.vllm.registration``).
The single-connector cases and the factory test involve no MultiConnector
and run unchanged. Every assertion of vLLM's file is kept as it is.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from multi_connector_adapter import load_adapted, rewrite
from vllm.config import KVTransferConfig

from composer.testing.multiconnector import composed_transfer_config

MODULE = "tests.v1.kv_connector.unit.test_hma_auto_config"

#: vLLM tests that cannot run here, and why: none.
NOT_APPLICABLE: dict[str, str] = {}

#: Releases reviewed, in the order of the counts in :data:`REWRITES` (the file
#: is the same in both).
RELEASES = ("0.32.0", "0.33.0")

#: (pattern, replacement, matches expected per release). Adds no line.
REWRITES: list[tuple[str, str, tuple[int, ...]]] = [
    # The two MultiConnector configurations (all children HMA; mixed).
    (
        r'KVTransferConfig\((\s*)kv_connector="MultiConnector",',
        r'_kvc.composed(\1kv_connector="MultiConnector",',
        (2, 2),
    ),
]


def adapt(source: str, release: str) -> str:
    return rewrite(source, release, REWRITES, RELEASES)


def composed(**kwargs: Any) -> Any:
    """The MultiConnector ``KVTransferConfig(**kwargs)`` as a ComposedConnector one."""
    return composed_transfer_config(KVTransferConfig(**kwargs))


def load() -> ModuleType:
    return load_adapted(MODULE, adapt, sys.modules[__name__])


__all__ = ["NOT_APPLICABLE", "composed", "load"]
