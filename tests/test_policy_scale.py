"""What a cache policy costs does not grow with the pool.

The tier's index (``kvc_offload_cpu.index.BlockIndex``, the one the scheduler half
and ``kvc simulate`` both drive) runs the same steps on a full pool of N slots and
of 16N: a request saving new blocks (each evicting one) and a hit on a block saved
earlier. The work of a fixed number of steps is counted, not timed: the Python
opcodes run (``sys.settrace`` with ``f_trace_opcodes``: a policy that walks its
lists in Python) and, for each step, the peak of the memory it allocates
(``tracemalloc``: a policy that copies a list in C, as ``arc`` once copied both of
its lists at every eviction). Both must be the same at 16N as at N, give or take
a small constant. The median step's allocation is compared: a dict that outgrows
its table reallocates it once in a while, in any policy, and that is amortized.
"""

from __future__ import annotations

import statistics
import tracemalloc
from collections.abc import Callable

import pytest
from kvc_offload_cpu.index import BlockIndex
from kvc_offload_cpu.policies import Admission

from composer.builtin_policies import BUILTIN
from composer.controls import Retention
from composer.testing.work import opcodes

#: The smaller pool, in slots; the larger is 16 times it.
N = 256
#: New blocks a request saves (each evicts one once the pool is full), and the steps counted.
PER_STEP = 4
STEPS = 48
#: A hit every step, on a block saved this many steps before (still held, by every policy).
HIT_AGE = N // (8 * PER_STEP)
EVICTION = sorted(p.name for p in BUILTIN if p.kind == "eviction")


def _key(i: int, j: int = 0) -> bytes:
    """Block ``j`` of request ``i``: every key the same size, so that bytes allocated do
    not grow with the request number."""
    return i.to_bytes(8, "big", signed=True) + bytes((j,))


class _Tier:
    """A tier of ``slots`` slots (its index and admission policy) and its requests."""

    def __init__(
        self, slots: int, eviction: str, store_threshold: int = 1, retention: str | None = None
    ) -> None:
        config = type("Config", (), {"store_threshold": store_threshold,
                                     "max_pinned_share": 0.25})()
        self.index = BlockIndex(slots, eviction, config, retention, clock=lambda: 0.0)
        self.admission = Admission("threshold", slots, config, self.index.health)
        self.repeat = store_threshold
        self.i = 0

    def step(self) -> None:
        """One request: its blocks admitted, the new ones saved (evicting as the policy
        says), and a hit on a block of an earlier request."""
        index, i = self.index, self.i
        keys = [_key(i, j) for j in range(PER_STEP)]
        for _ in range(self.repeat):  # (a threshold of n admits a request's nth sight)
            admitted = self.admission.admit(keys)
        for key in keys[:admitted]:
            entry = index.allocate(key)
            assert entry is not None
            index.mark_ready(entry)
        hit = index.ready(_key(i - HIT_AGE))
        if hit is not None:
            index.touch(hit)
        self.i += 1

    def fill(self) -> None:
        """Saved until full, then as much again: every list and count at its steady state."""
        while self.i * PER_STEP < 2 * self.index.num_slots:
            self.step()
        assert self.index.used_slots == self.index.num_slots


def _work(step: Callable[[], None], steps: int = STEPS) -> tuple[int, int]:
    """Opcodes run by ``steps`` calls of ``step``, and the median call's allocation peak
    (bytes above what was allocated when it started)."""
    with opcodes() as count:
        for _ in range(steps):
            step()
    peaks = []
    tracemalloc.start()
    try:
        for _ in range(steps):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            step()
            peaks.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    return count[0], int(statistics.median(peaks))


def _assert_flat(small: tuple[int, int], large: tuple[int, int], what: str) -> None:
    """The work at 16N within a small constant of the work at N."""
    (ops_n, bytes_n), (ops_16n, bytes_16n) = small, large
    assert ops_16n <= ops_n * 1.05 + 100, f"{what}: {ops_n:,} opcodes at N, {ops_16n:,} at 16N"
    assert bytes_16n <= bytes_n + 512, (
        f"{what}: a step allocates {bytes_n:,} bytes at N, {bytes_16n:,} at 16N"
    )


@pytest.mark.parametrize("eviction", EVICTION)
def test_an_eviction_policy_costs_the_same_at_any_pool_size(eviction: str) -> None:
    """Saves that evict, hits that touch: the same work on a pool 16 times larger."""
    work = []
    for slots in (N, 16 * N):
        tier = _Tier(slots, eviction)
        tier.fill()
        evictions = tier.index.evictions
        work.append(_work(tier.step))
        assert tier.index.evictions - evictions == 2 * STEPS * PER_STEP  # counted, then traced
    _assert_flat(work[0], work[1], eviction)


@pytest.mark.parametrize("eviction", EVICTION)
def test_admission_by_threshold_costs_the_same_at_any_pool_size(eviction: str) -> None:
    """``store_threshold: 2``: counts kept for four pools' worth of blocks, trimmed as it goes."""
    work = []
    for slots in (N, 16 * N):
        tier = _Tier(slots, eviction, store_threshold=2)
        tier.fill()
        work.append(_work(tier.step))
    _assert_flat(work[0], work[1], f"{eviction}, threshold 2")


@pytest.mark.parametrize("eviction", EVICTION)
def test_blocks_kept_at_the_front_of_the_order_are_not_walked_at_every_eviction(
    eviction: str,
) -> None:
    """A fifth of the pool pinned and a fifth under a TTL, the oldest blocks (the first
    the policy offers): an eviction passes them over once, not every time. Counted per
    eviction over a whole turn of the pool (the pool's size in evictions), where every
    kept block is passed over again."""
    per_eviction = []
    for slots in (N, 16 * N):
        tier = _Tier(slots, eviction, retention="request")
        tier.fill()
        index = tier.index
        oldest = sorted(index.entries(), key=lambda e: e.key)[: 2 * slots // 5]
        for k, entry in enumerate(oldest):
            asked = Retention(pin=True) if k % 2 else Retention(ttl_s=3600.0)
            assert index.retain(entry, asked)
        steps = slots // PER_STEP
        ops, peak = _work(tier.step, steps)
        assert all(e.key in index for e in oldest)  # kept, every one
        per_eviction.append((ops // (steps * PER_STEP), peak))
    _assert_flat(per_eviction[0], per_eviction[1], f"{eviction}, 40% kept")
