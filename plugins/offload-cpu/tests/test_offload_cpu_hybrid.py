"""offload-cpu with several KV cache groups (vLLM's hybrid manager), one kind at a time.

vLLM's own spec classes describe a model of one or two windowed layers (a
sliding window or a local-attention chunk of 64 tokens) and one full-attention
layer, each its own KV cache group (two windowed groups of one layout: one
bundle), every group's blocks in one shared region as vLLM's CPU backend lays
them out. A request is computed and saved, then a
repeat is looked up, allocated the way vLLM allocates a hit (null blocks where
the window has left) and loaded: the bytes must come back, only the window's
blocks of the windowed group are stored, and a state-space group gets no hits.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.layout import GroupLayout, layout_from_kv_cache_config
from kvc_offload_cpu.metadata import OffloadWorkerMeta
from kvc_offload_cpu.scheduler import SchedulerHalf
from kvc_offload_cpu.simulate import OffloadCPUModel
from kvc_offload_cpu.slot_patterns import SlotRecorder
from kvc_offload_cpu.worker import WorkerHalf
from offload_cpu_fakes import (
    HYBRID_LAYERS,
    CachedReqs,
    FakeRequest,
    FakeSchedulerOutput,
    NewReq,
    block_keys,
    hybrid_kv_cache_config,
    hybrid_layers,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)

from composer import (
    NULL_BLOCK,
    CanonicalKVCaches,
    KVGroup,
    KVRegion,
    NodeContext,
    RequestView,
    SimKVGroup,
    StepView,
)

BLOCK, KV_HEADS, HEAD, WINDOW, NUM_BLOCKS = 32, 2, 32, 64, 64
LAYERS = HYBRID_LAYERS
COMMON: dict[str, Any] = dict(
    block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16
)
WINDOWED = {
    "sliding_window": SlidingWindowSpec(**COMMON, sliding_window=WINDOW),
    "chunked_local": ChunkedLocalAttentionSpec(**COMMON, attention_chunk_size=WINDOW),
}


def kv_cache_config(windowed: Any, groups: int = 1) -> KVCacheConfig:
    kvc: KVCacheConfig = hybrid_kv_cache_config(
        windowed, FullAttentionSpec(**COMMON), NUM_BLOCKS, groups
    )
    return kvc


class Hybrid:
    """A scheduler half and a worker half over one shared region, driven like vLLM:
    ``groups`` windowed groups of ``kind`` (one bundle), then a full-attention one."""

    def __init__(self, kind: str, groups: int = 1, capacity: int = 4 << 20, **config: Any) -> None:
        self.spec = WINDOWED[kind]
        kvc = kv_cache_config(self.spec, groups)
        cfg = OffloadCPUConfig(capacity=capacity, save_mode="sync", **config)
        ctx = {"kv_cache_config": kvc}
        self.sched = SchedulerHalf(NodeContext("cpu", cfg, "both", "scheduler", **ctx))
        self.worker = WorkerHalf(NodeContext("cpu", cfg, "both", "worker", **ctx))
        page = self.spec.page_size_bytes
        self.region = torch.zeros(NUM_BLOCKS, page, dtype=torch.int8)
        layers = hybrid_layers(groups)
        kv_groups = tuple(
            KVGroup(g, kind if g < groups else "attention", BLOCK, (name,), (0,))
            for g, name in enumerate(layers)
        )
        self.worker.register_kv_caches(
            CanonicalKVCaches(NUM_BLOCKS, (KVRegion(self.region, layers),), kv_groups)
        )

    def step(self, out: FakeSchedulerOutput, computed: dict[int, int] | None = None) -> Any:
        meta = self.sched.build_connector_meta(StepView(out))
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        for block, value in (computed or {}).items():  # the forward
            self.region[block] = value
        self.worker.wait_for_save()
        self.worker.get_finished(set())
        errors = self.worker.get_block_ids_with_load_errors()
        self.sched.update_connector_output(self.worker.build_connector_worker_meta())
        self.worker.clear_connector_metadata()
        assert not errors
        return meta


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("kind", sorted(WINDOWED))
def test_a_repeat_loads_every_group_and_the_window_keeps_only_what_a_hit_needs(
    kind: str, groups: int
) -> None:
    h = Hybrid(kind, groups)
    full = groups  # the full-attention group comes last
    tokens = _prompt(200)  # 6 full blocks and a partial one
    a = RequestView(FakeRequest("a", tokens))
    assert h.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    ids_a = tuple(list(range(1 + 10 * g, 8 + 10 * g)) for g in range(groups + 1))
    h.sched.update_state_after_alloc(a, ids_a, 0)
    out = FakeSchedulerOutput(num_scheduled_tokens={"a": 200})
    out.scheduled_new_reqs.append(NewReq("a", ids_a, 0, tokens))
    written = {b: (b * 7) % 251 - 120 for group in ids_a for b in group}
    meta = h.step(out, written)
    saved = {(g, k) for t in meta.saves for g, k in zip(t.groups, t.positions, strict=True)}
    hit_blocks = (200 - 1) // BLOCK  # a repeat leaves one token to compute
    layout = layout_from_kv_cache_config(kv_cache_config(h.spec, groups))
    needed = set(layout.groups[0].needed(0, hit_blocks))
    assert {k for g, k in saved if g == full} == set(range(6))  # full attention: every block
    for g in range(groups):  # the window before the hit only
        assert {k for g_, k in saved if g_ == g} == needed
    assert len(needed) < 6
    # One entry a position and layout: the window groups' blocks of a position together.
    assert sorted(len(e.slots) for e in h.sched.index.entries()) == sorted(
        [1] * 6 + [groups] * len(needed)
    )
    h.sched.request_finished(a, ids_a[0])

    b = RequestView(FakeRequest("b", list(tokens)))
    assert h.sched.get_num_new_matched_tokens(b, 0) == (hit_blocks * BLOCK, False)
    # vLLM gives the windowed groups null blocks where the window has left.
    ids_b = tuple(
        [
            NULL_BLOCK if g < groups and k not in needed and k < hit_blocks else 31 + 10 * g + k
            for k in range(7)
        ]
        for g in range(groups + 1)
    )
    h.sched.update_state_after_alloc(b, ids_b, hit_blocks * BLOCK)
    meta = h.step(FakeSchedulerOutput())
    (load,) = meta.loads
    assert NULL_BLOCK not in load.block_ids
    assert sorted(zip(load.groups, load.positions, strict=True)) == sorted(
        [(g, k) for g in range(groups) for k in needed] + [(full, k) for k in range(hit_blocks)]
    )
    for g in range(groups + 1):
        for k in range(hit_blocks):
            if ids_b[g][k] != NULL_BLOCK:
                assert int(h.region[ids_b[g][k], 0]) == written[ids_a[g][k]], (g, k)


def test_a_shared_prefix_hits_only_at_a_retained_point() -> None:
    h = Hybrid("sliding_window", window_retention=4 * BLOCK)
    tokens = _prompt(400)  # 12 full blocks and a partial one
    a = RequestView(FakeRequest("a", tokens))
    h.sched.get_num_new_matched_tokens(a, 0)
    ids_a = (list(range(1, 14)), list(range(21, 34)))
    h.sched.update_state_after_alloc(a, ids_a, 0)
    out = FakeSchedulerOutput(num_scheduled_tokens={"a": 400})
    out.scheduled_new_reqs.append(NewReq("a", ids_a, 0, tokens))
    meta = h.step(out, {b: 1 for group in ids_a for b in group})
    window = {k for t in meta.saves for g, k in zip(t.groups, t.positions, strict=True) if g == 0}
    # Hit points every 4 blocks and at the prompt's end (block 12): 2 blocks before each.
    assert window == {2, 3, 6, 7, 10, 11}
    # A 6-block shared prefix: full attention has 6, the window serves the point at 4.
    c = RequestView(FakeRequest("c", tokens[: 6 * BLOCK] + _prompt(60, seed=1)))
    assert h.sched.get_num_new_matched_tokens(c, 0) == (4 * BLOCK, False)


def test_a_state_space_group_gets_no_hits_and_says_why() -> None:
    mamba = type("MambaSpec", (), {"block_size": 2048, "page_size_bytes": 8192})()
    full = FullAttentionSpec(**COMMON)
    kvc = SimpleNamespace(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            SimpleNamespace(layer_names=[LAYERS[0]], kv_cache_spec=mamba),
            SimpleNamespace(layer_names=[LAYERS[1]], kv_cache_spec=full),
        ],
        hash_block_size=BLOCK,
    )
    cfg = OffloadCPUConfig(capacity=4 << 20)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="granite-4-tiny"))
    sched = SchedulerHalf(
        NodeContext("cpu", cfg, "both", "scheduler", vllm_config=vllm_config, kv_cache_config=kvc)
    )
    assert sched.stats.disabled
    assert sched.disabled_reason is not None
    assert "granite-4-tiny" in sched.disabled_reason and "mamba" in sched.disabled_reason
    req = RequestView(FakeRequest("a", _prompt(200)))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


@pytest.mark.parametrize("kind", ["sliding_window", "chunked_local"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("retention", [0, 16, 48, 64, 1000])
def test_the_kept_blocks_of_a_whole_prompt_are_the_blocks_kept_one_by_one(
    kind: str, block_size: int, retention: int
) -> None:
    """kvc simulate asks GroupLayout.kept_blocks (ranges) where the scheduler half asks
    GroupLayout.kept per block: the same blocks, for every window, prompt and stop."""
    for window in (16, 24, 64, 100):
        layout = GroupLayout(kind, block_size, window)
        for prompt in range(0, 400, 7):
            for stop in (0, 1, prompt // block_size, prompt // block_size + 3):
                one_by_one = {k for k in range(stop) if layout.kept(k, prompt, retention)}
                assert layout.kept_blocks(stop, prompt, retention) == one_by_one, (
                    window, prompt, stop
                )


def _serve(
    h: Hybrid,
    rid: str,
    tokens: list[int],
    groups: int,
    params: dict[str, Any] | None = None,
    chunk: int = BLOCK,
    metas: list[Any] | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """One request (its ``kv_transfer_params``: ``params``) through the scheduler half
    as vLLM runs it (look up, allocate with null blocks outside the window, load,
    compute ``chunk`` tokens a step (a block), save, finish); its hit in blocks, and
    what the tier returned at its end. Each step's metadata goes to ``metas``."""
    view = RequestView(FakeRequest(rid, tokens, kv_transfer_params=params))
    hit = h.sched.get_num_new_matched_tokens(view, 0)[0] // BLOCK
    blocks = -(-len(tokens) // BLOCK)
    skipped = set(range(hit)) - set(h.sched.layout.groups[0].needed(0, hit))
    ids = tuple(
        [NULL_BLOCK if g < groups and k in skipped else 1 + 10 * g + k for k in range(blocks)]
        for g in range(groups + 1)
    )
    h.sched.update_state_after_alloc(view, ids, hit * BLOCK)
    done = hit * BLOCK
    while done < len(tokens):  # chunked prefill, a block a step
        n = min(chunk, len(tokens) - done)
        out = FakeSchedulerOutput(num_scheduled_tokens={rid: n})
        if done == hit * BLOCK:
            out.scheduled_new_reqs.append(NewReq(rid, ids, done, tokens))
        else:
            out.scheduled_cached_reqs = CachedReqs([rid], set(), [None], [done], {})
        meta = h.step(out)
        if metas is not None:
            metas.append(meta)
        done += n
    return hit, h.sched.request_finished(view, ids[0])[1]


@pytest.mark.parametrize("eviction", ["lru", "arc"])
@pytest.mark.parametrize("retention", [0, 2 * BLOCK])
@pytest.mark.parametrize("requests", [1, 2, 30])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_the_simulator_is_the_scheduler_half_on_a_hybrid(
    groups: int, requests: int, retention: int, eviction: str
) -> None:
    """kvc simulate's model of the node (its own index and rules) against the scheduler
    half driven as vLLM drives it, over windowed groups of one layout (a bundle) and a
    full-attention group, on pools that evict and one that does not: the same hit
    for every request, the same entries, slots and evictions after each. (Prefill
    runs a block a step: the simulator's saves complete at once, the real tier's
    at the end of their step.)"""
    slots = requests * 10 * (groups + 1)  # the pool holds ``requests`` of 10 blocks
    h = Hybrid(
        "sliding_window", groups, capacity=slots * h_page(), window_retention=retention,
        eviction=eviction,
    )
    sim = OffloadCPUModel(
        h.sched.config, block_size=BLOCK, bytes_per_block=h_page(),
        groups=[SimKVGroup("sliding_window", h_page(), WINDOW)] * groups
        + [SimKVGroup("attention", h_page())],
    )
    base = [_prompt(300, seed=s) for s in range(5)]
    # Repeats, extensions and a shared prefix with a new tail, in an order that evicts.
    prompts = [base[0], base[1], base[0], base[0][:200] + _prompt(90, seed=7), base[2],
               base[3], base[1], base[4], base[0] + _prompt(20, seed=8), base[2][:130],
               base[0], base[3]]
    for i, tokens in enumerate(prompts):
        keys = block_keys(tokens, BLOCK)
        start = sim.lookup(keys, 0, (len(tokens) - 1) // BLOCK)
        if start:
            sim.load(keys, 0, start)
        sim.save(keys, len(tokens), start)
        assert _serve(h, f"r{i}", tokens, groups)[0] == start, i
        assert len(h.sched.index) == len(sim.index), i
        assert h.sched.index.used_slots == sim.index.used_slots, i
        assert h.sched.index.evictions == sim.index.evictions, i
    assert (sim.index.evictions > 0) == (requests < 30)


def h_page() -> int:
    return int(WINDOWED["sliding_window"].page_size_bytes)


def test_a_steps_saves_sit_in_a_run_of_slots_per_bundle() -> None:
    """The scheduler half deals a request's new entries of a step bundle by bundle
    (``NumberedSlots.deal``): each bundle's blocks in one run of slots, in the order
    the save lists them (a copy takes it in one pass). Allocated entry by entry, a
    position's bundles would interleave."""
    h = Hybrid("sliding_window", 2, window_retention=2 * BLOCK)
    metas: list[Any] = []
    _serve(h, "a", _prompt(300), 2, chunk=300, metas=metas)
    (save,) = [t for meta in metas for t in meta.saves]
    assert len(h.sched.bundles.members) == 2
    for members in h.sched.bundles.members:
        slots = [s for s, g in zip(save.slots, save.groups, strict=True) if g in members]
        assert len(slots) > 2 * len(members)
        assert slots == list(range(slots[0], slots[0] + len(slots))), members


@pytest.mark.parametrize("groups", [1, 2])
def test_the_slot_recorder_numbers_slots_as_the_scheduler_half(groups: int) -> None:
    """The slot-patterns benchmark's recorder (kvc simulate's model on the tier's own
    numbering index, dealing a request's saves as the tier deals a step's) against
    the scheduler half, each prompt computed in one step (one batch, as the
    recorder's): the same hit, and every entry's slots the same, after every
    request, on a pool that evicts. (lru: the replay readies a position's entries
    before the next position's, and arc may evict them for it, where one step's
    are not ready yet; the test above prefills a block a step for that.)"""
    slots = 3 * 10 * (groups + 1)
    h = Hybrid("sliding_window", groups, capacity=slots * h_page(), window_retention=2 * BLOCK)
    rec = SlotRecorder(
        h.sched.config, block_size=BLOCK, bytes_per_block=h_page(), steady_only=False,
        groups=[SimKVGroup("sliding_window", h_page(), WINDOW)] * groups
        + [SimKVGroup("attention", h_page())],
    )
    base = [_prompt(300, seed=s) for s in range(5)]
    prompts = [base[0], base[1], base[0], base[0][:200] + _prompt(90, seed=7), base[2],
               base[3], base[1], base[4], base[0] + _prompt(20, seed=8), base[2][:130],
               base[0], base[3]]
    for i, tokens in enumerate(prompts):
        keys = block_keys(tokens, BLOCK)
        hit = rec.serve(keys, len(tokens), (len(tokens) - 1) // BLOCK)
        assert _serve(h, f"r{i}", tokens, groups, chunk=len(tokens))[0] == hit, i
        real = sorted(e.slots for e in h.sched.index.entries())
        assert real == sorted(e.slots for e in rec.index.entries()), i
    assert rec.index.evictions > 0


def test_a_bundle_is_ready_once_every_worker_saved_every_slot_and_goes_whole() -> None:
    """Two workers, two window groups of one layout: an entry is a hit only once both
    workers confirmed both slots; a failed save or a bad slot of one group drops the
    whole entry (its blocks are recomputed), and a late confirmation changes nothing."""
    kvc = kv_cache_config(WINDOWED["sliding_window"], 2)
    cfg = OffloadCPUConfig(capacity=4 << 20, window_retention=2 * BLOCK)
    two = SimpleNamespace(parallel_config=SimpleNamespace(world_size=2))
    sched = SchedulerHalf(
        NodeContext("cpu", cfg, "both", "scheduler", kv_cache_config=kvc, vllm_config=two)
    )
    tokens = _prompt(200)
    view = RequestView(FakeRequest("a", tokens))
    sched.get_num_new_matched_tokens(view, 0)
    ids = tuple(list(range(1 + 10 * g, 8 + 10 * g)) for g in range(3))
    sched.update_state_after_alloc(view, ids, 0)
    out = FakeSchedulerOutput(num_scheduled_tokens={"a": 200})
    out.scheduled_new_reqs.append(NewReq("a", ids, 0, tokens))
    (save,) = sched.build_connector_meta(StepView(out)).saves
    planned = list(zip(save.slots, save.gens, save.groups, save.positions, strict=True))
    window = {k: [(s, g) for s, g, grp, p in planned if grp < 2 and p == k] for k in range(6)}
    good, bad, corrupt = [k for k in range(6) if len(window[k]) == 2][:3]  # kept positions
    entry = {k: sched.index.get(block_keys(tokens, BLOCK)[k] + bytes((0,))) for k in range(6)}
    assert all(entry[k] is not None and len(entry[k].slots) == 2 for k in (good, bad, corrupt))

    def report(**kw: Any) -> None:
        sched.update_connector_output(OffloadWorkerMeta(**kw))

    first, second = window[good]
    report(saved={first: 2, second: 1})  # both workers one slot, one worker the other
    assert not entry[good].ready
    report(saved={second: 1}, save_failed={window[bad][0]})
    assert entry[good].ready and sched.index.get(entry[bad].key) is None
    report(saved={sg: 2 for sg in window[bad] + window[corrupt]})  # late: still gone
    assert sched.index.get(entry[bad].key) is None and entry[corrupt].ready
    report(load_failed={window[corrupt][1]})  # one group's slot found bad: the entry goes
    assert sched.index.get(entry[corrupt].key) is None and sched.index.get(entry[good].key)


def test_a_refused_pin_is_counted_in_blocks_on_a_hybrid() -> None:
    """The pin cap counts slots, and so does what the request is told: one entry of
    two window groups is two blocks."""
    h = Hybrid("sliding_window", 2, capacity=40 * h_page(), window_retention=2 * BLOCK,
               retention="request", max_pinned_share=0.1)  # 4 slots may be pinned
    tokens = _prompt(200)  # 6 blocks: 6 full-attention entries, 6 of two window groups
    assert _serve(h, "a", tokens, 2)[0] == 0
    hit, params = _serve(h, "b", tokens, 2, {"kv_retention": {"pin": True}})
    assert hit == 6 and params == {"kv_composer": {"retention": {"cpu": (
        "pin not granted for 14 of 18 blocks: max_pinned_share 0.1 of the tier is pinned"
    )}}}
