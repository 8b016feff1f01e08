"""A node's counters and their merge, without vLLM (composer.stats)."""

from __future__ import annotations

import subprocess
import sys

from composer.stats import NodeStats, counters_empty, flatten, merge, zeroed


def test_take_resets_counters_but_keeps_disabled() -> None:
    stats = NodeStats(tokens_loaded=5, disabled=True)
    assert stats.take()["tokens_loaded"] == 5
    assert stats.tokens_loaded == 0 and stats.disabled


def test_a_switched_off_node_is_reported_with_nothing_counted() -> None:
    stats = NodeStats()
    assert stats.is_empty()
    stats.disabled = True  # (switched off on the other process's word, nothing counted)
    assert stats.changes.seen and not stats.is_empty()
    assert stats.take()["disabled"] and not stats.is_empty()  # a state, kept


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


def test_a_request_counts_once_and_as_hit_only_when_served() -> None:
    stats = NodeStats()
    assert stats.is_empty()
    stats.count_request(512, 480)
    stats.count_request(512, 0)
    assert not stats.is_empty()
    snap = stats.take()
    counts = {k: snap[k] for k in snap if k.startswith(("requests_", "prompt_tokens_"))}
    assert counts == {
        "requests_looked_up": 2,
        "requests_hit": 1,
        "prompt_tokens_looked_up": 1024,
        "prompt_tokens_hit": 480,
    }


def test_zeroed_keeps_states_and_empties_counts() -> None:
    stats = NodeStats(tokens_loaded=5, disabled=True)
    stats.extra.add("evictions", 3)
    stats.add_time("start_load_kv", 0.5)
    snap = stats.take()
    assert not counters_empty(snap)
    zero = zeroed(snap)
    assert zero["tokens_loaded"] == 0 and zero["disabled"] is True
    assert zero["extra"] == {} and zero["hook_seconds"] == {}
    assert counters_empty(zero)  # a disabled node with no counts is empty


def test_flatten_names_counters_as_the_stat_logger_prints_them() -> None:
    stats = NodeStats(hits=2)
    stats.gauges["pool_use"] = 0.5
    stats.add_time("start_load_kv", 0.25)
    flat = flatten("cpu", stats.take())
    assert flat == {
        "cpu.hits": 2,
        "cpu.hook_seconds.start_load_kv": 0.25,
        "cpu.gauges.pool_use": 0.5,
    }


def test_the_pure_stats_need_no_vllm() -> None:
    code = "import sys, composer.stats; print(sorted(m for m in sys.modules if 'vllm' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
