"""Per-node stats, as vLLM aggregates, ships and logs them."""

from __future__ import annotations

import pickle

from composer.stats import NodeStats, merge
from composer.vllm.connector import ComposedConnector, ComposedStats


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


def test_take_resets_counters_but_keeps_disabled() -> None:
    stats = NodeStats(tokens_loaded=5, disabled=True)
    assert stats.take()["tokens_loaded"] == 5
    assert stats.tokens_loaded == 0 and stats.disabled


def test_counters_sum_and_gauges_keep_the_latest_across_steps_and_workers() -> None:
    first, later = NodeStats(), NodeStats()
    first.extra.add("evictions", 2)
    first.gauges["pool_use"] = 0.25
    later.extra.add("evictions")
    later.gauges["pool_use"] = 0.5
    merged = merge(first.take(), later.take())
    assert merged["extra"] == {"evictions": 3}
    assert merged["gauges"] == {"pool_use": 0.5}


def test_every_way_of_writing_a_counter_marks_the_node_changed() -> None:
    stats = NodeStats()
    writes = [
        lambda: setattr(stats, "tokens_loaded", 1),
        lambda: stats.extra.add("x"),
        lambda: stats.extra.update(y=1),
        lambda: stats.extra.setdefault("z", 1),
        lambda: stats.gauges.update(g=1),
        lambda: stats.add_time("start_load_kv", 0.1),
    ]
    for write in writes:
        stats.changes.seen = False
        write()
        assert stats.changes.seen
    stats.take()
    stats.changes.seen = False
    stats.take()  # a reset is not a change
    assert not stats.changes.seen and stats.gauges == {"g": 1}
