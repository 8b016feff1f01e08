"""What the tier admits, keeps and promotes: ``store_threshold``, ``eviction``,
``promote`` and a request's tier controls (``kv_store_tiers``, ``max_offload_tokens``,
``kv_retention``)."""

from __future__ import annotations

from typing import Any

import pytest
from kvc_offload_cpu.index import BlockIndex
from offload_cpu_fakes import BLOCK, SLOT, Engine, prompt

from composer import RequestView


def _run(eng: Engine, rid: str, tokens: list[int], **kw: Any) -> tuple[int, bool]:
    hit = eng.add(rid, tokens, **kw)
    eng.prefill(rid)
    eng.finish(rid)
    eng.settle()
    return hit


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_store_threshold_saves_a_block_once_that_many_requests_held_it(threshold: int) -> None:
    eng = Engine(save_mode="sync", store_threshold=threshold)
    p = prompt(1, 100)  # 3 full blocks
    hits = [_run(eng, f"r{i}", p)[0] for i in range(threshold + 1)]
    # Saved by the threshold-th request, served to the next one.
    assert hits == [0] * threshold + [96]
    assert eng.sched.stats.extra.get("blocks_not_admitted", 0) == 3 * (threshold - 1)


def test_store_threshold_admits_a_shared_prefix_before_the_rest() -> None:
    eng = Engine(save_mode="sync", store_threshold=2)
    shared = prompt(7, 64)  # 2 blocks
    _run(eng, "a", shared + prompt(8, 40))
    _run(eng, "b", shared + prompt(9, 40))  # the prefix is seen twice: saved
    assert len(eng.index) == 2
    assert _run(eng, "c", shared + prompt(10, 40))[0] == 64


@pytest.mark.parametrize(
    ("params", "saved"),
    [
        (None, 3),
        ({"kv_store_tiers": ["cpu"]}, 3),
        ({"kv_store_tiers": ["lmcache"]}, 0),
        ({"kv_store_tiers": []}, 0),
        ({"max_offload_tokens": 64}, 2),
        ({"max_offload_tokens": 70}, 2),  # whole blocks only
        ({"max_offload_tokens": 0}, 0),
        ({"kv_store_tiers": "cpu"}, 0),  # malformed: nothing saved
    ],
)
def test_a_requests_store_controls_limit_what_the_tier_saves(
    params: dict[str, Any] | None, saved: int
) -> None:
    eng = Engine(save_mode="sync")
    _run(eng, "a", prompt(1, 100), kv_transfer_params=params)
    assert len(eng.index) == saved
    assert eng.worker.stats.bytes_saved == saved * SLOT


@pytest.mark.parametrize(("promote", "saved", "promoted"), [("on_hit", 3, 2), ("never", 1, 0)])
def test_blocks_another_node_loaded_are_promoted_only_on_hit(
    promote: str, saved: int, promoted: int
) -> None:
    eng = Engine(save_mode="sync", promote=promote)
    # A slower node behind this one loads the first 64 tokens (as the chain tells it).
    _run(eng, "a", prompt(1, 100), loads=(("disk", 0, 2 * BLOCK),))
    assert len(eng.index) == saved
    assert eng.sched.stats.extra.get("blocks_promoted", 0) == promoted


def test_what_other_nodes_loaded_is_remembered_through_vllms_second_allocation() -> None:
    """vLLM allocates a request whose async load finished once more, with nothing
    to load (and so no ranges): promote: never still skips what another node loaded."""
    eng = Engine(save_mode="sync", promote="never")
    eng.add("a", prompt(1, 100), loads=(("disk", 0, 2 * BLOCK),))
    r = eng.running["a"]
    eng.sched.update_state_after_alloc(RequestView(r.req), (r.block_ids,), 0)
    eng.prefill("a")
    eng.finish("a")
    eng.settle()
    assert len(eng.index) == 1


def test_own_loads_are_never_saved_again() -> None:
    eng = Engine(save_mode="sync")
    p = prompt(1, 100)
    _run(eng, "a", p)
    saved = eng.worker.stats.bytes_saved
    assert _run(eng, "b", p, loads=(("cpu", 0, 96),))[0] == 96
    assert eng.worker.stats.bytes_saved == saved
    assert eng.sched.stats.extra.get("blocks_promoted", 0) == 0


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_pins_and_generations_hold_under_every_eviction_policy(eviction: Any) -> None:
    idx = BlockIndex(2, eviction)
    a, b = idx.allocate(b"a"), idx.allocate(b"b")
    assert a is not None and b is not None
    idx.mark_ready(a)
    idx.mark_ready(b)
    idx.pin(a)
    idx.touch(a)
    c = idx.allocate(b"c")  # a is pinned: b goes, whatever the policy prefers
    assert c is not None and c.slots == b.slots and c.gen == b.gen + 1
    assert idx.allocate(b"d") is None  # a pinned, c still saving
    idx.unpin(a)
    assert idx.reset() == 1 and len(idx) == 1  # c (saving) stays


def _fill(idx: BlockIndex, keys: list[bytes]) -> None:
    for key in keys:
        known = idx.get(key)
        if known is not None:
            idx.touch(known)
            continue
        entry = idx.allocate(key)
        assert entry is not None
        idx.mark_ready(entry)


def test_arc_keeps_reused_blocks_through_a_scan_that_lru_lets_flush_them() -> None:
    hot = [b"h1", b"h2"]
    scan = [bytes([i]) for i in range(8)]
    kept = {}
    for eviction in ("lru", "arc"):
        idx = BlockIndex(4, eviction)  # type: ignore[arg-type]
        _fill(idx, hot)
        _fill(idx, hot)  # seen again: reused
        _fill(idx, scan)  # one-off blocks, twice the pool
        kept[eviction] = [k in idx for k in hot]
    assert kept == {"lru": [False, False], "arc": [True, True]}


def test_arc_adapts_toward_recency_when_blocks_evicted_once_come_back() -> None:
    idx = BlockIndex(4, "arc")
    order = idx.policy
    _fill(idx, [b"a", b"b", b"a", b"b"])  # reused: the seen-again list
    _fill(idx, [b"c", b"d", b"e"])  # c evicted from the seen-once list
    assert order.p == 0 and b"c" in order.b1  # type: ignore[union-attr]
    _fill(idx, [b"c"])  # back: the seen-once list was too small
    assert order.p > 0 and b"c" in order.t2  # type: ignore[union-attr]


def _flood(eng: Engine, n: int, seed: int = 100) -> None:
    """``n`` one-off 3-block prompts: under lru, enough to evict anything older."""
    for i in range(n):
        _run(eng, f"flood{seed + i}", prompt(seed + i, 100))


@pytest.mark.parametrize(
    ("retention", "kept"),
    [
        (None, False),
        ({"pin": True}, True),
        ({"ttl_s": 3600}, True),
        ({"ttl_s": 0}, False),
        ({"priority": 5}, False),  # a tie-break only: nothing kept
    ],
)
def test_a_requests_kv_retention_keeps_its_blocks_through_a_flood(
    retention: dict[str, Any] | None, kept: bool
) -> None:
    eng = Engine(save_mode="sync", capacity=8 * SLOT, max_pinned_share=0.5)
    p = prompt(1, 100)  # 3 full blocks
    params = None if retention is None else {"kv_retention": retention}
    _run(eng, "session", p, kv_transfer_params=params)
    _flood(eng, 6)  # 18 blocks through an 8-block tier
    assert (_run(eng, "next-turn", p)[0] == 96) is kept


def test_an_unpinned_prefix_is_evicted_again_and_pins_are_capped() -> None:
    eng = Engine(save_mode="sync", capacity=8 * SLOT, max_pinned_share=0.5)  # 4 blocks
    system = prompt(1, 100)
    _run(eng, "pin", system, kv_transfer_params={"kv_retention": {"pin": True}})
    # A second pinned prompt: one block fits under the cap, two are refused.
    _run(eng, "more", prompt(2, 100), kv_transfer_params={"kv_retention": {"pin": True}})
    assert eng.sched.stats.extra.get("pins_refused") == 2
    # The request is told, by the node's name (the pinned one was not).
    reason = "pin not granted for 2 of 3 blocks: max_pinned_share 0.5 of the tier is pinned"
    assert eng.params["more"] == {"kv_composer": {"retention": {"cpu": reason}}}
    assert eng.params["pin"] is None
    _flood(eng, 4)
    assert _run(eng, "again", system)[0] == 96
    _run(eng, "unpin", system, kv_transfer_params={"kv_retention": {"pin": False}})
    _flood(eng, 4, seed=200)
    assert _run(eng, "gone", system)[0] == 0


def test_ttl_ends_and_kept_blocks_yield_by_priority() -> None:
    now = [0.0]
    eng = Engine(save_mode="sync", capacity=6 * SLOT)
    eng.index.clock = lambda: now[0]
    low, high = prompt(1, 100), prompt(2, 100)
    _run(eng, "low", low, kv_transfer_params={"kv_retention": {"ttl_s": 60, "priority": -1}})
    _run(eng, "high", high, kv_transfer_params={"kv_retention": {"ttl_s": 60, "priority": 1}})
    # The tier is full of kept blocks: a new prompt's blocks take the lowest priority's.
    _run(eng, "new", prompt(3, 100))
    assert _run(eng, "high2", high)[0] == 96 and _run(eng, "low2", low)[0] == 0
    now[0] = 61.0  # the TTLs have run out: plain lru again
    _flood(eng, 2)
    assert _run(eng, "high3", high)[0] == 0
