"""The scheduler and worker halves driven directly, over a real CPU-layout KV cache."""

from __future__ import annotations

import pytest
import torch
from kvc_offload_cpu.metadata import OffloadMetadata, Transfer
from offload_cpu_fakes import (
    BLOCK,
    SLOT,
    Engine,
    FakeSchedulerOutput,
    block_keys,
    content,
    corrupt,
    prompt,
)

from composer import StepView


@pytest.mark.parametrize("layout", ["block", "layer"])
@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_save_then_load_restores_identical_bytes(layout: str, save_mode: str) -> None:
    eng = Engine(save_mode=save_mode, layout=layout)
    p = prompt(1, 100)  # 3 full blocks + 4 tokens
    assert eng.add("a", p) == (0, False)
    eng.prefill("a")
    saved = [eng.block_bytes("a", b) for b in range(3)]
    eng.settle(1)
    assert len(eng.index) == 3
    assert eng.worker.stats.tokens_saved == 3 * BLOCK
    assert eng.worker.stats.bytes_saved == 3 * SLOT
    eng.finish("a")

    assert eng.add("b", p) == (96, False)
    eng.prefill("b")
    assert not eng.errors
    for b in range(3):  # loaded, not computed: the forward skipped them
        assert torch.equal(eng.block_bytes("b", b), saved[b])
        assert torch.equal(eng.block_bytes("b", b), content(p, b))
    assert eng.worker.stats.tokens_loaded == 96
    assert eng.worker.stats.bytes_loaded == 3 * SLOT
    # Counted by the chain, not by the node (tests/test_chain.py).
    assert eng.sched.stats.hits == 0 and eng.sched.stats.tokens_hit == 0


def test_load_really_copies() -> None:
    """Without the load the blocks stay zero: the test above can fail."""
    eng = Engine(save_mode="sync")
    p = prompt(1, 100)
    eng.add("a", p)
    eng.prefill("a")
    eng.finish("a")
    eng.add("b", p)
    eng.sched._pending_loads.clear()  # drop the load
    eng.prefill("b")
    assert not torch.equal(eng.block_bytes("b", 0), content(p, 0))


def test_shared_prefix_hits_across_requests() -> None:
    eng = Engine(save_mode="sync")
    shared = prompt(2, 64)
    eng.add("a", shared + prompt(3, 50))
    eng.prefill("a")
    eng.finish("a")
    other = shared + prompt(4, 50)
    assert eng.add("b", other) == (64, False)
    eng.prefill("b")
    assert torch.equal(eng.block_bytes("b", 1), content(other, 1))
    # and a prompt sharing only part of the first block hits nothing
    assert eng.add("c", shared[:20] + prompt(5, 80)) == (0, False)


def test_partial_trailing_block_never_stored_or_served() -> None:
    eng = Engine(save_mode="sync")
    p = prompt(6, 70)  # blocks 0, 1 full; block 2 holds 6 tokens
    eng.add("a", p)
    eng.prefill("a")
    assert len(eng.index) == 2
    eng.finish("a")
    longer = p + prompt(7, 60)  # same first 70 tokens, block 2 now full but different
    assert eng.add("b", longer) == (64, False)


def test_at_least_one_prompt_token_left_to_compute() -> None:
    eng = Engine(save_mode="sync")
    p = prompt(8, 96)  # exactly 3 full blocks
    eng.add("a", p)
    eng.prefill("a")
    assert len(eng.index) == 3
    eng.finish("a")
    ext, _ = eng.add("b", p)
    assert ext == 64  # not 96: the last block would leave nothing to compute
    assert ext <= len(p) - 1 and ext % BLOCK == 0
    short = prompt(9, 33)
    eng.add("c", short)
    eng.prefill("c")
    eng.finish("c")
    assert eng.add("d", short) == (32, False)  # 33 tokens: one block, one token left
    one = short[:32]
    assert eng.add("e", one) == (0, False)


def test_lookup_is_side_effect_free_and_respects_min_blocks() -> None:
    eng = Engine(save_mode="sync", min_blocks=3)
    p = prompt(10, 100)
    eng.add("a", p)
    eng.prefill("a")
    eng.finish("a")
    from offload_cpu_fakes import FakeRequest

    from composer import RequestView

    view = RequestView(FakeRequest("q", p))
    s = eng.sched
    before = s.stats.lookups
    assert s.get_num_new_matched_tokens(view, 0) == (96, False)
    assert s.get_num_new_matched_tokens(view, 0) == (96, False)
    assert s.get_num_new_matched_tokens(view, 32) == (0, False)  # only 2 new blocks < 3
    assert s.get_num_new_matched_tokens(view, 5) == (0, False)  # unaligned: no hit
    assert s.stats.lookups == before  # the chain counts lookups, not the node


def test_lru_eviction_under_capacity_pressure_keeps_memory_bounded() -> None:
    eng = Engine(save_mode="sync", capacity=6 * SLOT)
    assert eng.pool.num_slots == 6 and eng.pool.nbytes <= 6 * SLOT
    a, b, c = prompt(11, 100), prompt(12, 100), prompt(13, 100)
    for rid, p in (("a", a), ("b", b)):
        eng.add(rid, p)
        eng.prefill(rid)
        eng.finish(rid)
    assert len(eng.index) == 6
    assert eng.add("a2", a) == (96, False)  # touches a's blocks: b is now least recent
    eng.prefill("a2")
    eng.finish("a2")
    eng.add("c", c)
    eng.prefill("c")
    eng.finish("c")
    assert len(eng.index) == 6 and eng.index.used_slots == 6
    assert eng.pool.nbytes <= int(eng.config.capacity)
    assert eng.sched.stats.extra["evictions"] == 3
    assert eng.add("a3", a)[0] == 96
    assert eng.add("b2", b)[0] == 0
    assert eng.add("c2", c)[0] == 96


def test_pinned_slots_are_never_evicted() -> None:
    eng = Engine(save_mode="sync", capacity=3 * SLOT)
    a = prompt(14, 100)
    eng.add("a", a)
    eng.prefill("a")
    eng.finish("a")
    eng.add("b", a)  # pins a's 3 slots until its load is confirmed
    eng.add("c", prompt(15, 100))
    out = eng.prefill("c")  # c's saves find no evictable slot
    assert eng.sched.stats.extra["save_skipped_full"] >= 1
    assert len(eng.index) == 3 and eng.index.used_slots == 3
    del out
    eng.prefill("b")
    assert not eng.errors
    assert torch.equal(eng.block_bytes("b", 2), content(a, 2))


def test_slot_overwritten_while_load_pending_is_a_load_error() -> None:
    eng = Engine(save_mode="sync")
    a = prompt(16, 100)
    eng.add("a", a)
    eng.prefill("a")
    eng.finish("a")
    eng.add("b", a)
    load_meta = eng.sched.build_connector_meta(
        StepView(
            FakeSchedulerOutput()
        )
    )
    (load,) = load_meta.loads
    # Before the worker runs that load, slot of block 1 is rewritten with a newer block
    # (what a lost pin or a racing writer would do).
    slot, gen = load.slots[1], load.gens[1]
    w = eng.worker
    w.bind_connector_metadata(
        OffloadMetadata(saves=[Transfer("x", [slot], [gen + 1], [eng.free[0]], [0], [0])])
    )
    w.wait_for_save()
    w.build_connector_worker_meta()
    eng.region[eng.running["b"].block_ids] = 0
    w.bind_connector_metadata(load_meta)
    w.start_load_kv()
    errors = w.get_block_ids_with_load_errors()
    bid = eng.running["b"].block_ids
    assert errors == {bid[1]}
    assert torch.equal(eng.region[bid[0]], content(a, 0))  # the good ones still load
    assert torch.equal(eng.region[bid[2]], content(a, 2))
    assert not eng.region[bid[1]].any()  # the stale slot was never copied
    wmeta = w.build_connector_worker_meta()
    assert wmeta.req_load_failed == {"b": 1}
    assert wmeta.loaded == {"b": 1}
    assert w.stats.extra["stale_slot_loads"] == 1


@pytest.mark.parametrize("layout", ["block", "layer"])
def test_checksum_mismatch_is_a_load_error_and_the_block_is_dropped(layout: str) -> None:
    eng = Engine(save_mode="sync", checksums=True, layout=layout)
    a = prompt(17, 100)
    eng.add("a", a)
    eng.prefill("a")
    eng.finish("a")
    slot = _slot_of(eng, a, 1)
    corrupt(eng.pool, slot, SLOT - 1000)  # one flipped byte in host memory
    eng.add("b", a)
    eng.prefill("b")
    bid = eng.running["b"].block_ids
    assert eng.errors == {bid[1]}
    assert torch.equal(eng.region[bid[0]], content(a, 0))
    assert eng.worker.stats.extra["checksum_failures"] == 1
    assert eng.worker.stats.errors == 1
    # the corrupt block left the index: the next lookup stops before it
    eng.finish("b")
    assert eng.add("c", a) == (32, False)


def test_corruption_without_checksums_serves_wrong_bytes() -> None:
    """The detection test above can fail: unchecked, a corrupt slot is served as is."""
    eng = Engine(save_mode="sync", checksums=False)
    a = prompt(17, 100)
    eng.add("a", a)
    eng.prefill("a")
    eng.finish("a")
    slot = _slot_of(eng, a, 1)
    corrupt(eng.pool, slot, 1000)
    eng.add("b", a)
    eng.prefill("b")
    bid = eng.running["b"].block_ids
    assert not eng.errors
    assert not torch.equal(eng.region[bid[1]], content(a, 1))


def test_blocks_computed_over_a_failed_load_are_not_saved() -> None:
    eng = Engine(save_mode="sync", checksums=True)
    a = prompt(18, 100)
    eng.add("a", a)
    eng.prefill("a")
    eng.finish("a")
    corrupt(eng.pool, _slot_of(eng, a, 0), 0)
    longer = a[:96] + prompt(19, 64)  # loads blocks 0-2, computes and would save 3, 4
    eng.add("b", longer)
    eng.prefill("b")
    assert eng.running["b"].block_ids[0] in eng.errors
    assert len(eng.index) == 2  # block 0 dropped, b's new blocks not stored
    # vLLM recomputes from block 0: the node saves the recomputed blocks again
    r = eng.running["b"]
    r.num_computed = 0
    from offload_cpu_fakes import CachedReqs, FakeSchedulerOutput

    out = FakeSchedulerOutput(num_scheduled_tokens={"b": len(longer)})
    out.scheduled_cached_reqs = CachedReqs(["b"], set(), [None], [0], {})
    eng.step(out)
    assert len(eng.index) == 5


def test_async_save_holds_finished_request_until_saved() -> None:
    eng = Engine(save_mode="async")
    a = prompt(20, 100)
    eng.add("a", a)
    with eng.background_paused():
        eng.prefill("a")
        hold = eng.finish("a")
        assert hold  # the background copy still reads a's blocks
        assert eng.sched._pending_hold == ["a"]
        eng.step()
        assert "a" in eng.held and "a" not in eng.finished_sending
    eng.settle()
    assert "a" in eng.finished_sending and not eng.held
    assert eng.add("b", a) == (96, False)
    eng.prefill("b")
    assert torch.equal(eng.block_bytes("b", 2), content(a, 2))


def test_saving_blocks_are_not_hits_until_confirmed() -> None:
    eng = Engine(save_mode="sync")
    a = prompt(21, 100)
    eng.add("a", a)
    meta = eng.sched.build_connector_meta(
        StepView(_prefill_out(eng, "a"))
    )
    assert sum(len(t) for t in meta.saves) == 3
    from offload_cpu_fakes import FakeRequest

    from composer import RequestView

    assert eng.sched.get_num_new_matched_tokens(RequestView(FakeRequest("q", a)), 0)[0] == 0


def test_decode_blocks_saved_only_in_all_mode() -> None:
    for mode, expected in (("prompt", 1), ("all", 3)):
        eng = Engine(save_mode="sync", save=mode)
        p = prompt(22, 40)
        eng.add("a", p)
        eng.prefill("a")
        for t in range(60):
            eng.decode("a", 100 + t)
        assert len(eng.index) == expected, mode
        if mode == "all":
            r = eng.running["a"]
            toks = r.req.all_token_ids
            eng.finish("a")
            ext, _ = eng.add("b", toks[:97])
            assert ext == 96
            eng.prefill("b")
            assert torch.equal(eng.block_bytes("b", 2), content(toks, 2))


def test_role_load_only_never_saves_and_save_only_never_serves() -> None:
    eng = Engine(save_mode="sync", role="load")
    eng.add("a", prompt(23, 100))
    eng.prefill("a")
    assert len(eng.index) == 0
    eng2 = Engine(save_mode="sync", role="save")
    p = prompt(24, 100)
    eng2.add("a", p)
    eng2.prefill("a")
    eng2.finish("a")
    assert len(eng2.index) == 3
    assert eng2.add("b", p) == (0, False)


def test_vllm_block_hashes_are_the_keys_when_given() -> None:
    eng = Engine(save_mode="sync")
    p = prompt(25, 100)
    hashes = [bytes([i]) * 32 for i in range(3)]
    eng.add("a", p, block_hashes=hashes)
    eng.prefill("a")
    assert all(h in eng.index for h in hashes)
    eng.finish("a")
    # same hashes, other tokens: vLLM's hash is the identity of the block
    assert eng.add("b", p, block_hashes=hashes)[0] == 96


def test_async_load_protocol() -> None:
    eng = Engine(save_mode="async", load_mode="async")
    a = prompt(26, 100)
    eng.add("a", a)
    eng.prefill("a")
    eng.finish("a")
    eng.settle()
    ext, is_async = eng.add("b", a)
    assert (ext, is_async) == (96, True)
    eng.step()  # the load starts; vLLM keeps the request waiting
    eng.worker.drain()
    eng.step()
    assert "b" in eng.finished_recving
    bid = eng.running["b"].block_ids
    for b in range(3):
        assert torch.equal(eng.region[bid[b]], content(a, b))


def test_worker_meta_aggregates_and_needs_every_worker() -> None:
    eng = Engine(save_mode="sync")
    eng.sched.num_workers = 2
    a = prompt(27, 100)
    eng.add("a", a)
    out = _prefill_out(eng, "a")
    meta = eng.sched.build_connector_meta(StepView(out))
    w = eng.worker
    w.bind_connector_metadata(meta)
    eng._forward(out)
    w.wait_for_save()
    one = w.build_connector_worker_meta()
    from offload_cpu_fakes import FakeRequest

    from composer import RequestView

    view = RequestView(FakeRequest("q", a))
    eng.sched.update_connector_output(one)
    assert eng.sched.get_num_new_matched_tokens(view, 0)[0] == 0  # one of two workers
    from kvc_offload_cpu.metadata import OffloadWorkerMeta

    both = OffloadWorkerMeta().aggregate(one)
    assert both.saved == one.saved
    eng.sched.update_connector_output(both)
    assert eng.sched.get_num_new_matched_tokens(view, 0)[0] == 96


def test_reset_cache_drops_unpinned_blocks() -> None:
    eng = Engine(save_mode="sync")
    a = prompt(28, 100)
    eng.add("a", a)
    eng.prefill("a")
    eng.finish("a")
    assert eng.sched.reset_cache() is True
    assert len(eng.index) == 0 and eng.index.used_slots == 0
    assert eng.add("b", a) == (0, False)


def test_stats_report_pool_use_and_throughput() -> None:
    eng = Engine(save_mode="sync", capacity=10 * SLOT)
    a = prompt(29, 100)
    eng.add("a", a)
    eng.prefill("a")
    eng.finish("a")
    eng.add("b", a)
    eng.prefill("b")
    s, w = eng.sched.stats.gauges, eng.worker.stats.gauges
    assert s["pool_slots"] == 10 and s["pool_slots_used"] == 3
    assert s["pool_bytes_used"] == 3 * SLOT and s["pool_use"] == pytest.approx(0.3)
    assert w["save_gib_s"] > 0 and w["load_gib_s"] > 0
    assert eng.worker.stats.extra["save_copy_s"] > 0 and eng.worker.stats.extra["load_copy_s"] > 0
    assert eng.sched.stats.extra["misses"] == 1  # (hits: the chain counts them)


def _prefill_out(eng: Engine, rid: str) -> object:
    from offload_cpu_fakes import FakeSchedulerOutput, NewReq

    r = eng.running[rid]
    out = FakeSchedulerOutput(num_scheduled_tokens={rid: r.req.num_prompt_tokens - r.num_computed})
    out.scheduled_new_reqs.append(
        NewReq(rid, (list(r.block_ids),), r.num_computed, list(r.req.prompt_token_ids))
    )
    return out


def _slot_of(eng: Engine, tokens: list[int], block: int) -> int:

    entry = eng.index.ready(block_keys(tokens, BLOCK)[block])
    assert entry is not None
    return int(entry.slots[0])
