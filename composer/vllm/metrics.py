"""vLLM's side of the per-node stats: the stats object it ships, and its Prometheus metrics.

The chain reports ``{node id: {"plugin", "counters", "node"?, "connector"?}}``
(see :mod:`composer.stats` for the counters); here that becomes vLLM's
``KVConnectorStats`` (aggregated across steps and workers, shipped to the
frontend as a dict, rebuilt there) and ``KVConnectorPromMetrics``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from composer.stats import counters_empty, flatten, merge, zeroed

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from composer.pipeline import ResolvedPipeline


@dataclass
class ComposedStats(KVConnectorStats):
    """Stats per **node id**: ``{node: {"plugin", "counters", "node"?, "connector"?}}``.

    ``node`` is what the node's own ``get_kv_connector_stats`` returned; for a
    native node that is its connector's ``KVConnectorStats``, shipped as that
    class's ``to_dict()`` payload and rebuilt in that class on the other side
    (``connector``: the name and module path to find it), as MultiConnector does.
    """

    @property
    def native(self) -> dict[str, KVConnectorStats]:
        """Each node's own stats object by node id (MultiKVConnectorStats.data)."""
        out: dict[str, KVConnectorStats] = {}
        for node_id, entry in self.data.items():
            own = entry.get("node")
            if isinstance(own, KVConnectorStats):
                out[node_id] = own
        return out

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for node_id, entry in self.data.items():
            own = entry.get("node")
            if isinstance(own, KVConnectorStats):
                entry = {**entry, "node": own.to_dict()}
            out[node_id] = entry
        return out

    def reset(self) -> None:
        # As MultiKVConnectorStats: every node keeps its entry, emptied in place.
        for entry in self.data.values():
            entry["counters"] = _zeroed(entry.get("counters", {}))
            own = entry.get("node")
            if isinstance(own, KVConnectorStats):
                own.reset()
            elif own is not None:
                del entry["node"]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for node_id, entry in other.data.items():
            mine = self.data.get(node_id)
            if mine is None:
                self.data[node_id] = entry
                continue
            mine["counters"] = merge(mine.get("counters", {}), entry.get("counters", {}))
            if "node" in entry:
                own = mine.get("node")
                mine["node"] = (
                    entry["node"] if own is None else _merge_node_stats(own, entry["node"])
                )
            if "connector" in entry:
                mine.setdefault("connector", entry["connector"])
        return self

    def reduce(self) -> dict[str, Any]:
        # The chain's counters flat ("node.key", as the stat logger prints them);
        # a node's own stats under its node id, reduced by their own class (as
        # MultiKVConnectorStats reduces each connector's).
        out: dict[str, Any] = {}
        for node_id, entry in self.data.items():
            out.update(flatten(node_id, entry.get("counters", {})))
            own = entry.get("node")
            if isinstance(own, KVConnectorStats):
                if not own.is_empty():
                    out[node_id] = own.reduce()
            elif isinstance(own, dict):
                for key, value in own.items():
                    if isinstance(value, int | float):
                        out[f"{node_id}.{key}"] = value
        return out

    def is_empty(self) -> bool:
        return all(_entry_is_empty(entry) for entry in self.data.values())


def _zeroed(counters: dict[str, Any]) -> dict[str, Any]:
    return zeroed(counters)


def _entry_is_empty(entry: dict[str, Any]) -> bool:
    if not counters_empty(entry.get("counters", {})):
        return False
    own = entry.get("node")
    if isinstance(own, KVConnectorStats):
        return own.is_empty()
    return not own


def _merge_node_stats(a: Any, b: Any) -> Any:
    if isinstance(a, KVConnectorStats):
        return a.aggregate(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return merge(a, b)
    return b


def _native_stats_class_owner(connector: dict[str, Any]) -> type[KVConnectorBase_V1]:
    """The connector class whose ``build_kv_connector_stats`` rebuilds a node's stats."""
    module_path = connector.get("module_path")
    if module_path:
        return cast(
            type[KVConnectorBase_V1],
            getattr(importlib.import_module(module_path), connector["name"]),
        )
    # Unknown names raise vLLM's own "Connector '...' is not registered." error.
    return cast(
        type[KVConnectorBase_V1], KVConnectorFactory.get_connector_class_by_name(connector["name"])
    )


def rebuild_stats(data: dict[str, Any] | None) -> ComposedStats:
    """The stats of ``ComposedStats.to_dict()`` again, each native node's in its own class.

    A native node whose connector builds no stats object from the payload (its
    class keeps vLLM's default) loses its own part, as in MultiConnector; the
    entry stays while it has counters.
    """
    out: dict[str, Any] = {}
    for node_id, entry in (data or {}).items():
        own = entry.get("node")
        connector = entry.get("connector")
        if own is not None and not isinstance(own, KVConnectorStats) and connector:
            entry = dict(entry)
            rebuilt = _native_stats_class_owner(connector).build_kv_connector_stats(data=own)
            if rebuilt is None:
                del entry["node"]
                if _entry_is_empty(entry):
                    continue
            else:
                entry["node"] = rebuilt
        out[node_id] = entry
    return ComposedStats(data=out)


def build_prom_metrics(
    vllm_config: VllmConfig,
    metric_types: dict[Any, Any],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
    pipeline: ResolvedPipeline,
    native_classes: Iterable[tuple[str, type[KVConnectorBase_V1], Any]],
) -> KVConnectorPromMetrics | None:
    """``ComposedConnector.build_prom_metrics``: each native node's own metrics.

    ``native_classes``: (node id, connector class, the node's vLLM config) of
    every native node of ``pipeline``.
    """
    per_node: dict[str, KVConnectorPromMetrics] = {}
    for node_id, connector_cls, temp in native_classes:
        prom = connector_cls.build_prom_metrics(
            temp, metric_types, labelnames, per_engine_labelvalues
        )
        if prom is not None:
            per_node[node_id] = prom
    if not per_node:
        return None
    return ComposedPromMetrics(
        vllm_config, metric_types, labelnames, per_engine_labelvalues, per_node
    )


class ComposedPromMetrics(KVConnectorPromMetrics):
    """Forwards each native node's stats to that node's own Prometheus metrics."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        per_node: dict[str, KVConnectorPromMetrics],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.per_node = per_node

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # Each node's metrics get the flat payload that node's connector ships
        # (its stats' to_dict()), as vLLM hands a lone connector's metrics.
        for node_id, entry in transfer_stats_data.items():
            prom = self.per_node.get(node_id)
            own = entry.get("node") if isinstance(entry, dict) else None
            if prom is not None and own is not None:
                payload = own.to_dict() if isinstance(own, KVConnectorStats) else own
                prom.observe(payload, engine_idx)


class _StatsType:
    """Wraps the chain's per-node stats, naming each native node's connector."""

    def __init__(self) -> None:
        self.natives: dict[str, dict[str, str]] = {}

    def __call__(self, data: dict[str, Any]) -> ComposedStats:
        for node_id, ident in self.natives.items():
            entry = data.get(node_id)
            if entry is not None and "node" in entry:
                entry["connector"] = ident
        return ComposedStats(data=data)
