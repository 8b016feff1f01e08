"""Per-node stats, as vLLM aggregates, ships and logs them."""

from __future__ import annotations

import inspect
import pickle
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorStats,
)
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from composer.stats import NodeStats
from composer.testing.multiconnector import pipeline_for
from composer.vllm.connector import ComposedConnector, ComposedStats
from composer.vllm.metrics import ComposedPromMetrics


def snapshot(**counters: int) -> dict:
    stats = NodeStats()
    for key, value in counters.items():
        setattr(stats, key, value)
    stats.add_time("start_load_kv", 0.5)
    return stats.take()


def test_stats_are_kept_per_node_id_and_summed_across_workers_and_steps() -> None:
    a = ComposedStats(
        data={"cpu": {"plugin": "offload-cpu", "counters": snapshot(tokens_loaded=64)}}
    )
    b = ComposedStats(
        data={
            "cpu": {"plugin": "offload-cpu", "counters": snapshot(tokens_loaded=32, errors=1)},
            "cpu2": {"plugin": "offload-cpu", "counters": snapshot(tokens_saved=96)},
        }
    )
    merged = a.aggregate(b)
    reduced = merged.reduce()
    # Two nodes of the same plugin type stay apart (MultiConnector merges by class).
    assert reduced["cpu.tokens_loaded"] == 96
    assert reduced["cpu.errors"] == 1
    assert reduced["cpu2.tokens_saved"] == 96
    assert reduced["cpu.hook_seconds.start_load_kv"] == 1.0


def test_stats_survive_the_trip_to_the_logger_process() -> None:
    stats = ComposedStats(data={"cpu": {"plugin": "offload-cpu", "counters": snapshot(hits=2)}})
    payload = pickle.loads(pickle.dumps(stats.to_dict()))
    rebuilt = ComposedConnector.build_kv_connector_stats(payload)
    assert rebuilt is not None and rebuilt.reduce()["cpu.hits"] == 2
    assert ComposedConnector.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]


# --------------------------------------------------------------------------- #
# A native node's own stats, across vLLM's process boundary (engine -> frontend).
# --------------------------------------------------------------------------- #


class OutOfTreeStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {"moved": []}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data["moved"] = self.data.get("moved", []) + other.data["moved"]
        return self

    def reduce(self) -> dict[str, int | float]:
        return {"Moved": sum(self.data.get("moved", []))}

    def is_empty(self) -> bool:
        return not self.data.get("moved")


class OutOfTreeConnector(KVConnectorBase_V1):
    """Found by module path only: its stats class is known to no registry."""

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return OutOfTreeStats(data=data if data is not None else {"moved": []})


def _importable(name: str) -> bool:
    try:
        KVConnectorFactory.get_connector_class_by_name(name)
    except ImportError:  # MoRIIO needs msgpack, not part of vLLM's CPU build
        return False
    return True


SITE_PACKAGES = Path(vllm.__file__).resolve().parents[1]


def _installed(name: str) -> bool:
    """Registered by an installed package (vLLM, LMCache), not by a test module:
    vLLM's own test suite (tests/vllm_suite), when collected first, registers mocks."""
    cls = KVConnectorFactory.get_connector_class_by_name(name)
    return Path(inspect.getfile(cls)).resolve().is_relative_to(SITE_PACKAGES)


IN_TREE = sorted(
    n for n in KVConnectorFactory._registry if _importable(n) and _installed(n)
)


def _own_stats(cls: type) -> bool:
    return cls.build_kv_connector_stats.__func__ is not (  # type: ignore[attr-defined]
        KVConnectorBase_V1.build_kv_connector_stats.__func__  # type: ignore[attr-defined]
    )


#: Every connector of the installed vLLM that has its own stats class, and one
#: out-of-tree connector: (connector identity as a node records it, its class).
WITH_OWN_STATS = [
    ({"name": name}, KVConnectorFactory.get_connector_class_by_name(name))
    for name in IN_TREE
    if _own_stats(KVConnectorFactory.get_connector_class_by_name(name))
] + [({"name": "OutOfTreeConnector", "module_path": __name__}, OutOfTreeConnector)]

NIXL = {
    "transfer_duration": [1.0, 2.0],
    "post_duration": [0.1, 0.2],
    "bytes_transferred": [1024, 2048],
    "num_descriptors": [10, 20],
    "num_failed_transfers": [],
    "num_failed_notifications": [],
    "num_failed_handshakes": [],
    "num_kv_expired_reqs": [],
    "num_notifications_after_expiry": [],
}


def across_processes(stats: ComposedStats) -> dict[str, Any]:
    """What vLLM's frontend receives: the scheduler's to_dict(), through msgpack."""
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert decoded.scheduler_stats is not None
    return cast(dict[str, Any], decoded.scheduler_stats.kv_connector_stats)


def native_entry(connector: dict[str, str], own: KVConnectorStats) -> dict[str, Any]:
    return {"plugin": "vllm", "counters": snapshot(lookups=1), "node": own, "connector": connector}


@pytest.mark.parametrize(
    ("connector", "cls"), WITH_OWN_STATS, ids=[c["name"] for c, _ in WITH_OWN_STATS]
)
def test_a_native_nodes_stats_are_rebuilt_in_their_own_class(
    connector: dict[str, str], cls: type[KVConnectorBase_V1]
) -> None:
    own = cls.build_kv_connector_stats(data=None)
    assert own is not None
    stats = ComposedStats(data={"node-a": native_entry(connector, own)})
    rebuilt = ComposedConnector.build_kv_connector_stats(across_processes(stats))
    assert isinstance(rebuilt, ComposedStats)
    assert type(rebuilt.data["node-a"]["node"]) is type(own)
    assert rebuilt.data["node-a"]["node"].to_dict() == own.to_dict()
    assert rebuilt.data["node-a"]["counters"]["lookups"] == 1


def test_what_the_frontend_logs_and_observes_is_each_nodes_own_reduced_stats() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlKVConnectorStats

    stats = ComposedStats(
        data={
            "nixl": native_entry({"name": "NixlConnector"}, NixlKVConnectorStats(data=NIXL)),
            "mine": native_entry(
                {"name": "OutOfTreeConnector", "module_path": __name__},
                OutOfTreeStats(data={"moved": [3, 4]}),
            ),
        }
    )
    payload = across_processes(stats)
    # Prometheus: each node's metrics get the flat dict its connector ships.
    assert payload["nixl"]["node"] == NIXL
    logging = KVConnectorLogging(
        KVTransferConfig(
            kv_connector="ComposedConnector",
            kv_connector_module_path="composer.vllm.connector",
            kv_role="kv_both",
        )
    )
    logging.observe(payload)
    logging.observe(payload)  # a second interval: aggregated in each node's class
    accumulated = logging.transfer_stats_accumulator
    assert isinstance(accumulated, ComposedStats) and not accumulated.is_empty()
    reduced = accumulated.reduce()
    assert reduced["nixl"]["Num successful transfers"] == 4
    assert reduced["nixl.lookups"] == 2
    assert reduced["mine"]["Moved"] == 14


def test_reset_empties_every_node_in_place_and_is_empty_looks_inside() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlKVConnectorStats

    stats = ComposedStats(
        data={
            "nixl": native_entry({"name": "NixlConnector"}, NixlKVConnectorStats(data=dict(NIXL))),
            "cpu": {"plugin": "offload-cpu", "counters": snapshot(tokens_loaded=5)},
        }
    )
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty() and set(stats.data) == {"nixl", "cpu"}
    assert stats.data["nixl"]["node"].data["transfer_duration"] == []
    stats.data["nixl"]["node"].data["transfer_duration"].append(1.0)
    assert not stats.is_empty()
    stats.reset()
    stats.data["cpu"]["counters"]["tokens_loaded"] = 1
    assert not stats.is_empty()


def test_a_node_without_a_stats_class_keeps_only_its_counters() -> None:
    stats = ComposedStats(
        data={
            "plain": native_entry({"name": "ExampleConnector"}, KVConnectorStats(data={"x": [1]})),
        }
    )
    rebuilt = ComposedConnector.build_kv_connector_stats(across_processes(stats))
    assert isinstance(rebuilt, ComposedStats)
    assert "node" not in rebuilt.data["plain"]
    assert rebuilt.data["plain"]["counters"]["lookups"] == 1


class _Metric:
    """Stands in for a prometheus_client metric class (no global registry)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.seen: list[Any] = []

    def labels(self, *args: Any, **kwargs: Any) -> _Metric:
        return self

    def observe(self, value: Any) -> None:
        self.seen.append(value)

    def inc(self, value: Any = 1) -> None:
        self.seen.append(value)

    def set(self, value: Any) -> None:
        self.seen.append(value)


def test_each_native_nodes_prometheus_metrics_observe_their_own_payload() -> None:
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlKVConnectorStats

    pipeline = pipeline_for(
        [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
        ]
    )
    parent = KVTransferConfig(
        kv_connector="ComposedConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"pipeline": pipeline},
    )
    prom = ComposedConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=parent),  # type: ignore[arg-type]
        {Gauge: _Metric, Counter: _Metric, Histogram: _Metric},
        ["engine"],
        {0: ["0"]},
    )
    assert prom is not None
    stats = ComposedStats(
        data={
            "NixlConnector": native_entry(
                {"name": "NixlConnector"}, NixlKVConnectorStats(data=NIXL)
            ),
            "ExampleConnector": {"plugin": "vllm", "counters": snapshot(lookups=1)},
        }
    )
    # NIXL's own observe raised KeyError on anything but its flat dict.
    prom.observe(across_processes(stats), engine_idx=0)


def test_every_node_gets_prometheus_series_with_node_and_plugin_labels() -> None:
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    pipeline = pipeline_for(
        [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
        ]
    )
    parent = KVTransferConfig(
        kv_connector="ComposedConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"pipeline": pipeline},
    )
    types = {
        cls: partial(cls, registry=registry)  # a private registry: no global state
        for cls in (Gauge, Counter, Histogram)
    }
    prom = ComposedConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=parent),  # type: ignore[arg-type]
        types,
        ["model_name", "engine"],
        {0: ["m", "0"]},
    )
    assert prom is not None
    node_labels = {"engine": "0", "model_name": "m", "plugin": "vllm"}

    def value(name: str, node: str, **extra: str) -> float:
        wanted = {**node_labels, "node": node, **extra}
        found = [
            sample.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for sample in family.samples
            if sample.name == name and sample.labels == wanted
        ]
        assert len(found) == 1, (name, wanted)
        return found[0]

    # Every node is listed before any traffic, at 0.
    for node in ("NixlConnector", "ExampleConnector"):
        assert value("vllm:kv_composer_lookups_total", node) == 0
    first, later = NodeStats(lookups=3, hits=2, tokens_loaded=64), NodeStats(lookups=1)
    first.count_request(100, 64)
    later.count_request(50, 0)
    first.extra.add("evictions", 5)
    first.gauges["pool_use"] = 0.25
    first.add_time("start_load_kv", 0.5)
    first.unavailable["wait_for_save"] = 2
    later.unavailable.update(wait_for_save=1, get_num_new_matched_tokens=4)
    later.gauges["pool_use"] = 0.75
    later.disabled = True
    # Per tenant (a tenant's name may hold ":"; a counter's may not).
    first.tenant_add("tokens_hit", "acme:eu", 32)
    later.tenant_add("tokens_hit", "acme:eu", 16)
    later.tenant_add("blocks_evicted", "*", 3)
    first.tenant_gauges["blocks_held:acme:eu"] = 9
    later.tenant_gauges["blocks_held:acme:eu"] = 7
    for stats in (first, later):
        payload = ComposedStats(
            data={"ExampleConnector": {"plugin": "vllm", "counters": stats.take()}}
        )
        prom.observe(across_processes(payload), engine_idx=0)
    ex = "ExampleConnector"
    assert value("vllm:kv_composer_lookups_total", ex) == 4  # summed
    assert value("vllm:kv_composer_hits_total", ex) == 2
    assert value("vllm:kv_composer_tokens_loaded_total", ex) == 64
    assert value("vllm:kv_composer_requests_looked_up_total", ex) == 2
    assert value("vllm:kv_composer_requests_hit_total", ex) == 1
    assert value("vllm:kv_composer_prompt_tokens_looked_up_total", ex) == 150
    assert value("vllm:kv_composer_prompt_tokens_hit_total", ex) == 64
    assert value("vllm:kv_composer_events_total", ex, event="evictions") == 5
    assert value("vllm:kv_composer_gauge", ex, gauge="pool_use") == 0.75  # the latest
    assert value("vllm:kv_composer_hook_seconds_total", ex, hook="start_load_kv") == 0.5
    assert value("vllm:kv_composer_unavailable_total", ex, hook="wait_for_save") == 3
    lookups = value("vllm:kv_composer_unavailable_total", ex, hook="get_num_new_matched_tokens")
    assert lookups == 4
    assert value("vllm:kv_composer_disabled", ex) == 1
    tenant = {"tenant": "acme:eu"}
    assert value("vllm:kv_composer_tenant_total", ex, **tenant, counter="tokens_hit") == 48
    assert value("vllm:kv_composer_tenant_total", ex, tenant="*", counter="blocks_evicted") == 3
    assert value("vllm:kv_composer_tenant_gauge", ex, **tenant, gauge="blocks_held") == 7
    assert value("vllm:kv_composer_lookups_total", "NixlConnector") == 0  # untouched


def test_metrics_show_the_policy_in_force_and_the_one_it_replaced() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}

    prom = ComposedPromMetrics(
        SimpleNamespace(kv_transfer_config=None),  # type: ignore[arg-type]
        types,
        ["model_name", "engine"],
        {0: ["m", "0"]},
        {},
        nodes={"cpu": "offload-cpu"},
    )

    def policies() -> dict[tuple[str, str], float]:
        return {
            (s.labels["kind"], s.labels["policy"]): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples
            if s.name == "vllm:kv_composer_policy" and s.labels["node"] == "cpu"
        }

    prom.observe({"cpu": {"counters": {"policies": {"eviction": "arc", "admission": "threshold"}}}})
    assert policies() == {("eviction", "arc"): 1.0, ("admission", "threshold"): 1.0}
    switched = "arc → lru after 1,203 evictions"
    prom.observe({"cpu": {"counters": {"policies": {"eviction": switched}}}})
    assert policies() == {
        ("eviction", "arc"): 0.0, ("eviction", switched): 1.0, ("admission", "threshold"): 1.0
    }
