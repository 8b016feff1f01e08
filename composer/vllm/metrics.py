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

from composer.stats import counters_empty, flatten, merge, split_tenant, zeroed

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
) -> KVConnectorPromMetrics:
    """``ComposedConnector.build_prom_metrics``: every node's counters, and each
    native node's own metrics.

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
    return ComposedPromMetrics(
        vllm_config,
        metric_types,
        labelnames,
        per_engine_labelvalues,
        per_node,
        nodes={node.id: node.plugin.name for node in pipeline.nodes},
    )


#: Prometheus name prefix. vLLM's own metrics start with ``vllm:`` and vLLM
#: unregisters every ``vllm`` collector when it builds its loggers again.
PREFIX = "vllm:kv_composer_"

#: NodeStats fields exported as counters (``<PREFIX><field>_total``).
COUNTERS = {
    "lookups": "Lookups asked of the node (get_num_new_matched_tokens; a request may be "
    "asked more than once).",
    "hits": "Lookups the node answered with at least one block.",
    "requests_looked_up": "Requests looked up in the node, each counted once.",
    "requests_hit": "Requests looked up in the node that it served tokens of.",
    "prompt_tokens_looked_up": "Prompt tokens of the requests looked up in the node.",
    "prompt_tokens_hit": "Prompt tokens the node served of the requests looked up.",
    "tokens_hit": "Prompt tokens the node served (that arrived in vLLM's KV cache).",
    "tokens_loaded": "Prompt tokens loaded from the node into vLLM's KV cache.",
    "tokens_saved": "Tokens the node stored.",
    "bytes_loaded": "Bytes loaded from the node.",
    "bytes_saved": "Bytes stored by the node.",
    "errors": "Errors of the node's hooks (load errors included).",
}


class ComposedPromMetrics(KVConnectorPromMetrics):
    """Every node's counters and gauges as Prometheus metrics with ``node`` and
    ``plugin`` labels; each native node's stats also go to that node's own metrics.

    Series (after vLLM's ``model_name``/``engine`` labels, then ``node``, ``plugin``):
    ``vllm:kv_composer_<counter>_total`` for :data:`COUNTERS`,
    ``vllm:kv_composer_hook_seconds_total{hook}`` (time spent in each hook),
    ``vllm:kv_composer_unavailable_total{hook}`` (calls that found the node's store away),
    ``vllm:kv_composer_events_total{event}`` (a plugin's own counters:
    evictions, load_errors, ...), ``vllm:kv_composer_gauge{gauge}`` (a plugin's
    current values: pool_use, load_gib_s, ...), ``vllm:kv_composer_tenant_total{tenant,
    counter}`` and ``vllm:kv_composer_tenant_gauge{tenant, gauge}`` (per tenant: blocks
    held, tokens served, blocks evicted), ``vllm:kv_composer_disabled`` (1 once the
    node is switched off), ``vllm:kv_composer_policy{kind, policy}`` (a tier's cache
    policy of each kind in force: 1; the one it replaced, 0; ``policy`` is its name,
    or how it was switched off: ``lfu → lru after 1,203 evictions``).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        per_node: dict[str, KVConnectorPromMetrics],
        nodes: dict[str, str] | None = None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.per_node = per_node
        #: node id -> plugin name
        self.nodes = dict(nodes or {})
        names = [*labelnames, "node", "plugin"]
        # Any: vLLM types its metric classes as a union of prometheus_client's
        # (or Ray's wrappers); each is used as the kind it was built as.
        counter_cls: Any = self._counter_cls
        gauge_cls: Any = self._gauge_cls
        self.counters: dict[str, Any] = {
            key: counter_cls(name=f"{PREFIX}{key}", documentation=doc, labelnames=names)
            for key, doc in COUNTERS.items()
        }
        self.hook_seconds: Any = counter_cls(
            name=f"{PREFIX}hook_seconds",
            documentation="Seconds spent in the node's hooks.",
            labelnames=[*names, "hook"],
        )
        self.unavailable: Any = counter_cls(
            name=f"{PREFIX}unavailable",
            documentation="Calls that found the node's store away (a miss, a skipped save, "
            "recomputed blocks): not errors.",
            labelnames=[*names, "hook"],
        )
        self.events: Any = counter_cls(
            name=f"{PREFIX}events",
            documentation="A plugin's own counters (evictions, load_errors, ...).",
            labelnames=[*names, "event"],
        )
        self.gauges: Any = gauge_cls(
            name=f"{PREFIX}gauge",
            documentation="A plugin's current values (pool_use, load_gib_s, ...).",
            labelnames=[*names, "gauge"],
            multiprocess_mode="mostrecent",
        )
        self.tenant_counts, self.tenant_gauges = self._tenant_metrics(names)
        self.disabled: Any = gauge_cls(
            name=f"{PREFIX}disabled",
            documentation="1 once the node has been switched off.",
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        self.policy = self._policy_metric(names)
        # Every node's series exist from the start (at 0), so that a scrape
        # before the first request already lists the pipeline's nodes.
        for engine in per_engine_labelvalues:
            for node_id in self.nodes:
                for counter in self.counters.values():
                    counter.labels(*self._labels(engine, node_id))
                self.disabled.labels(*self._labels(engine, node_id)).set(0)

    def _tenant_metrics(self, names: list[str]) -> tuple[Any, Any]:
        counter_cls: Any = self._counter_cls
        gauge_cls: Any = self._gauge_cls
        counts = counter_cls(
            name=f"{PREFIX}tenant",
            documentation="A node's counts per tenant (vLLM's cache_salt, as its quotas name "
            "it; * for the others): tokens_hit, blocks_evicted, ...",
            labelnames=[*names, "tenant", "counter"],
        )
        gauges = gauge_cls(
            name=f"{PREFIX}tenant_gauge",
            documentation="A node's current values per tenant: blocks_held, ...",
            labelnames=[*names, "tenant", "gauge"],
            multiprocess_mode="mostrecent",
        )
        return counts, gauges

    def _policy_metric(self, names: list[str]) -> Any:
        """``policy{kind, policy}``: a tier's cache policy in force of each kind at 1."""
        #: The policy shown in force, by (engine, node, kind): set to 0 when replaced.
        self._policy_shown: dict[tuple[int, str, str], str] = {}
        gauge_cls: Any = self._gauge_cls
        return gauge_cls(
            name=f"{PREFIX}policy",
            documentation="A tier's cache policy of each kind: 1 the one in force (its name, "
            "or how the configured one was switched off: 'lfu → lru after 1,203 evictions'), "
            "0 one it replaced.",
            labelnames=[*names, "kind", "policy"],
            multiprocess_mode="mostrecent",
        )

    def _labels(self, engine_idx: int, node_id: str) -> list[object]:
        plugin = self.nodes.get(node_id, "")
        return [*self.per_engine_labelvalues[engine_idx], node_id, plugin]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for node_id, entry in transfer_stats_data.items():
            if not isinstance(entry, dict):
                continue
            self._observe_counters(node_id, entry, engine_idx)
            # Each node's own metrics get the flat payload that node's connector
            # ships (its stats' to_dict()), as vLLM hands a lone connector's metrics.
            prom = self.per_node.get(node_id)
            own = entry.get("node")
            if prom is not None and own is not None:
                payload = own.to_dict() if isinstance(own, KVConnectorStats) else own
                prom.observe(payload, engine_idx)

    def _observe_counters(self, node_id: str, entry: dict[str, Any], engine_idx: int) -> None:
        counters = entry.get("counters")
        if not isinstance(counters, dict) or not counters:
            return  # nothing counted since the last report
        if node_id not in self.nodes:  # a node the pipeline did not list up front
            self.nodes[node_id] = str(entry.get("plugin", ""))
        labels = self._labels(engine_idx, node_id)
        for key, counter in self.counters.items():
            value = counters.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                counter.labels(*labels).inc(value)
        for hook, seconds in _numbers(counters.get("hook_seconds")):
            if seconds > 0:
                self.hook_seconds.labels(*labels, hook).inc(seconds)
        for hook, count in _numbers(counters.get("unavailable")):
            if count > 0:
                self.unavailable.labels(*labels, hook).inc(count)
        for event, count in _numbers(counters.get("extra")):
            if count > 0:
                self.events.labels(*labels, event).inc(count)
        for gauge, value in _numbers(counters.get("gauges")):
            self.gauges.labels(*labels, gauge).set(value)
        for key, count in _numbers(counters.get("tenants")):
            if count > 0:
                name, tenant = split_tenant(key)
                self.tenant_counts.labels(*labels, tenant, name).inc(count)
        for key, value in _numbers(counters.get("tenant_gauges")):
            name, tenant = split_tenant(key)
            self.tenant_gauges.labels(*labels, tenant, name).set(value)
        if "disabled" in counters:
            self.disabled.labels(*labels).set(1 if counters["disabled"] else 0)
        self._observe_policies(engine_idx, node_id, labels, counters.get("policies"))

    def _observe_policies(
        self, engine_idx: int, node_id: str, labels: list[object], policies: object
    ) -> None:
        """Each kind's policy in force at 1, and the one it replaced at 0."""
        if not isinstance(policies, dict):
            return
        for kind, policy in policies.items():
            kind, policy = str(kind), str(policy)
            shown = self._policy_shown.get((engine_idx, node_id, kind))
            if shown == policy:
                continue
            if shown is not None:
                self.policy.labels(*labels, kind, shown).set(0)
            self.policy.labels(*labels, kind, policy).set(1)
            self._policy_shown[engine_idx, node_id, kind] = policy


def _numbers(mapping: object) -> list[tuple[str, float]]:
    if not isinstance(mapping, dict):
        return []
    return [
        (str(k), float(v))
        for k, v in mapping.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]


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
