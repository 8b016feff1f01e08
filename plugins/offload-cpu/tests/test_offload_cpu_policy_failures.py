"""The scheduler half reports the cache policies in force: on the node's stats from the
start, and, once a policy raised and was switched off, the switch (``arc → lru after
N evictions``), counted as ``policy_fallbacks``; ``/metrics`` shows the policy in force
at 1 and the one it replaced at 0. (The index and ``kvc simulate``:
``tests/test_policy_failures.py``.)"""

from __future__ import annotations

from typing import Any

import pytest
import structlog
from offload_cpu_fakes import Engine, prompt


def _fill(eng: Engine, requests: int, first: int = 0) -> None:
    """``requests`` requests of 3 blocks each, saved (sync) and finished."""
    for n in range(first, first + requests):
        eng.add(f"r{n}", prompt(n, 100))
        eng.prefill(f"r{n}")
        eng.finish(f"r{n}")
        eng.step()


def test_the_policies_in_force_are_on_the_nodes_stats_from_the_start() -> None:
    eng = Engine(save_mode="sync", eviction="arc", store_threshold=1)
    snapshot = eng.sched.stats.take()
    assert snapshot["policies"] == {
        "eviction": "arc", "admission": "threshold", "retention": "request"
    }


def test_a_policy_that_raises_is_switched_off_counted_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    eng = Engine(save_mode="sync", eviction="arc", capacity=4 * 16384)  # 4 blocks
    _fill(eng, 2)  # 6 blocks in 4 slots: two evictions
    assert eng.index.evictions == 2
    eng.sched.stats.take()

    def broken(block: Any, evicted: bool) -> None:
        raise RuntimeError("arc bug")

    monkeypatch.setattr(eng.index.policy, "removed", broken)
    with structlog.testing.capture_logs() as logs:
        _fill(eng, 2, first=2)
    said = [e for e in logs if e["log_level"] == "error"]
    assert len(said) == 1 and said[0]["hook"] == "removed" and said[0]["policy"] == "arc"
    snapshot: dict[str, Any] = eng.sched.stats.take()
    assert snapshot["policies"]["eviction"] == "arc → lru after 2 evictions"
    assert snapshot["extra"]["policy_fallbacks"] == 1
    assert len(eng.index) == 4  # lru goes on: nothing lost, the pool still full
    # Kept across reports, as gauges.
    _fill(eng, 1, first=4)
    later: dict[str, Any] = eng.sched.stats.take()
    assert later["policies"]["eviction"] == "arc → lru after 2 evictions"
