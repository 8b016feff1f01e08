"""The tier's vLLM KV cache events: BlockStored / BlockRemoved with medium CPU.

Requests are vLLM's own ``Request`` objects whose ``block_hashes`` vLLM's own
hasher computes (sha256, as vLLM configures it), and vLLM's own ``BlockPool``
publishes its events for the same tokens: the tier must name the same hashes.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import msgspec
import offload_cpu_fakes
import pytest
import torch
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.metadata import OffloadWorkerMeta
from kvc_offload_cpu.scheduler import SchedulerHalf
from kvc_offload_cpu.worker import WorkerHalf
from offload_cpu_fakes import (
    BLOCK,
    SLOT,
    Engine,
    FakeSchedulerOutput,
    NewReq,
    Running,
    block_keys,
    corrupt,
    hybrid_kv_cache_config,
    hybrid_layers,
    kv_cache_config,
    prompt,
)
from vllm import SamplingParams
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from composer import (
    CanonicalKVCaches,
    KVGroup,
    KVRegion,
    NodeContext,
    RequestView,
    StepView,
    discover,
    load_pipeline,
)
from composer.testing.chains import chain_for

init_none_hash(sha256)  # what vLLM's EngineCore does with its default hash algorithm


def ext(block_hash: bytes) -> Any:
    """A hash as vLLM's events carry it (a 64-bit int by default, else the bytes)."""
    return maybe_convert_block_hash(block_hash)  # type: ignore[arg-type]


EVENTS_ON = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True))
EVENTS_OFF = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False))


def vllm_request(
    req_id: str, tokens: list[int], hash_block_size: int = BLOCK, lora: Any = None
) -> Request:
    return Request(
        req_id,
        list(tokens),
        SamplingParams(max_tokens=8),
        None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
        lora_request=lora,
    )


class VllmEngine(Engine):
    """:class:`Engine` admitting vLLM's own ``Request`` objects."""

    def __init__(self, hash_block_size: int = BLOCK, **config: Any) -> None:
        super().__init__(**config)
        self.hash_block_size = hash_block_size

    def add(self, req_id: str, prompt: list[int], **kw: Any) -> tuple[int, bool]:
        req = vllm_request(req_id, prompt, self.hash_block_size, **kw)
        view = RequestView(req)
        self.sched.on_new_request(view)
        hit, is_async = self.sched.get_num_new_matched_tokens(view, 0)
        assert hit is not None
        ids = [self.free.pop(0) for _ in range(-(-len(prompt) // BLOCK))]
        self.region[ids] = 0
        self.sched.update_state_after_alloc(view, (ids,), hit)
        self.running[req_id] = Running(req, view, ids, hit, hit)  # type: ignore[arg-type]
        return hit, is_async

    def request(self, req_id: str) -> Request:
        return self.running[req_id].req  # type: ignore[return-value]

    def events(self) -> list[Any]:
        return list(self.sched.take_events())


def gpu_events(req: Request, num_blocks: int, block_size: int, hash_block_size: int) -> list[Any]:
    """What vLLM's own prefix cache publishes when it caches ``req``'s first blocks."""
    pool = BlockPool(16, True, hash_block_size, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(req, blocks, 0, num_blocks, block_size, 0)
    return pool.take_events()


def stored_chain(events: list[Any]) -> tuple[list[Any], list[Any | None], list[int]]:
    """Hashes, parents and tokens of consecutive BlockStored events, flattened."""
    hashes: list[Any] = []
    parents: list[Any | None] = []
    tokens: list[int] = []
    for e in events:
        assert isinstance(e, BlockStored)
        parents.append(e.parent_block_hash)
        parents.extend(e.block_hashes[:-1])
        hashes.extend(e.block_hashes)
        tokens.extend(e.token_ids)
    return hashes, parents, tokens


@pytest.mark.parametrize("hash_block_size", [BLOCK, BLOCK // 2])
def test_stored_blocks_carry_vllms_own_hashes_and_payload(
    hash_block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM may hash at a finer grain than the block size (hash_block_size)
    fine = dataclasses.replace(kv_cache_config(64), hash_block_size=hash_block_size)
    monkeypatch.setattr(offload_cpu_fakes, "kv_cache_config", lambda _: fine)
    eng = VllmEngine(hash_block_size, save_mode="sync")
    assert eng.sched.hash_ratio == BLOCK // hash_block_size
    p = prompt(1, 100)  # 3 full blocks and 4 tokens
    lora = LoRARequest("adapter", 7, "/nowhere")
    eng.add("a", p, lora=lora)
    eng.prefill("a")
    req = eng.request("a")
    events = eng.events()
    assert [type(e) for e in events] == [BlockStored] * 3  # one per block, as vLLM's CPU tier
    r = BLOCK // hash_block_size
    for k, e in enumerate(events):
        assert e.block_hashes == [ext(req.block_hashes[(k + 1) * r - 1])]
        assert e.parent_block_hash == (ext(req.block_hashes[k * r - 1]) if k else None)
        assert e.token_ids == p[k * BLOCK : (k + 1) * BLOCK]
        assert e.block_size == BLOCK
        assert e.medium == MEDIUM_CPU == "CPU"
        assert (e.lora_id, e.lora_name) == (7, "adapter")
        assert e.group_idx == 0
        assert e.kv_cache_spec_kind == "full_attention"
        assert e.kv_cache_spec_sliding_window is None
        assert e.ownership is None  # the chain names the node
    # vLLM's own prefix cache publishes the same hashes, parents and tokens.
    gpu = gpu_events(req, 3, BLOCK, hash_block_size)
    assert stored_chain(events) == stored_chain(gpu)
    assert all(g.medium == "GPU" for g in gpu)
    # and they are vLLM's hash function over the tokens, chained
    if r == 1:
        parent = None
        for k, e in enumerate(events):
            start, end = k * BLOCK, (k + 1) * BLOCK
            extra, _ = generate_block_hash_extra_keys(req, start, end, 0)  # the LoRA's name
            parent = hash_block_tokens(sha256, parent, p[start:end], extra)
            assert e.block_hashes == [ext(parent)]
    assert eng.events() == []  # taken once


def test_eviction_removes_the_same_hashes_after_they_were_stored() -> None:
    eng = VllmEngine(save_mode="sync", capacity=3 * SLOT)  # three slots
    a, b = prompt(2, 100), prompt(3, 100)
    eng.add("a", a)
    eng.prefill("a")
    hashes_a = [ext(h) for h in eng.request("a").block_hashes]
    eng.finish("a")
    stored = eng.events()
    assert [e.block_hashes for e in stored] == [[h] for h in hashes_a]
    eng.add("b", b)
    eng.prefill("b")
    events = eng.events()
    # b's saves evict a's blocks first (one BlockRemoved), then b's are stored.
    removed, *stored_b = events
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == hashes_a
    assert (removed.medium, removed.group_idx, removed.ownership) == ("CPU", 0, None)
    assert [type(e) for e in stored_b] == [BlockStored] * 3
    assert [e.block_hashes[0] for e in stored_b] == [ext(h) for h in eng.request("b").block_hashes]
    assert eng.sched.stats.extra["evictions"] == 3
    # vLLM's publisher can send them: they encode and decode as vLLM's batch type.
    batch = KVEventBatch(ts=0.0, events=stored + events)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch)
    assert decoded.events == stored + events


def test_dropped_and_reset_blocks_are_removed_and_saves_in_flight_are_not_announced() -> None:
    eng = VllmEngine(save_mode="sync", checksums=True)
    a = prompt(4, 100)
    eng.add("a", a)
    eng.prefill("a")
    keys = list(eng.request("a").block_hashes)  # the tier's keys: vLLM's hashes
    eng.finish("a")
    hashes = [e.block_hashes[0] for e in eng.events()]
    assert hashes == [ext(k) for k in keys]
    # a corrupt slot: the load fails its checksum, the block leaves the tier
    entry = eng.index.ready(keys[1])
    assert entry is not None
    corrupt(eng.pool, entry.slots[0], SLOT - 1000)
    eng.add("b", a)
    eng.prefill("b")
    (removed,) = eng.events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [hashes[1]]
    # a reset drops every other block: removed too, never twice
    eng.finish("b")
    eng.sched.reset_cache()
    removed = [h for e in eng.events() for h in e.block_hashes]
    assert sorted(removed) == sorted([hashes[0], hashes[2]])
    eng.sched.shutdown()
    assert eng.events() == []


def test_a_failed_save_is_never_announced_and_shutdown_removes_what_the_tier_held() -> None:
    eng = VllmEngine(save_mode="sync")
    eng.add("a", prompt(5, 70))  # 2 full blocks
    view = eng.running["a"].view
    out = FakeSchedulerOutput(num_scheduled_tokens={"a": 70})
    out.scheduled_new_reqs.append(NewReq("a", (eng.running["a"].block_ids,), 0, prompt(5, 70)))
    meta = eng.sched.build_connector_meta(StepView(out))
    (save,) = meta.saves
    failed = (save.slots[0], save.gens[0])
    eng.sched.update_connector_output(
        OffloadWorkerMeta(saved={(save.slots[1], save.gens[1]): 1}, save_failed={failed})
    )
    (stored,) = eng.events()
    assert stored.block_hashes == [ext(view.block_hashes[1])]
    eng.sched.shutdown()
    (removed,) = eng.events()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [ext(view.block_hashes[1])]


@pytest.mark.parametrize(
    ("events", "vllm_config", "on"),
    [
        (True, None, True),  # outside vLLM (tests): the option decides
        (True, EVENTS_ON, True),
        (True, EVENTS_OFF, False),  # vLLM publishes nothing: the tier builds nothing
        (True, SimpleNamespace(kv_events_config=None), False),
        (False, EVENTS_ON, False),
    ],
)
def test_events_only_when_asked_and_vllm_publishes(
    events: bool, vllm_config: Any, on: bool
) -> None:
    cfg = OffloadCPUConfig(capacity=64 * SLOT, save_mode="sync", events=events)
    kvc = kv_cache_config(64)
    sched = SchedulerHalf(
        NodeContext("cpu", cfg, "both", "scheduler", vllm_config=vllm_config, kv_cache_config=kvc)
    )
    assert (sched.events is not None) == on
    # off: the chain does not even call the hook
    assert sched.direct_hooks() == ({} if on else {"take_events": None, "shutdown": None})
    p = prompt(6, 100)
    view = RequestView(vllm_request("a", p))
    sched.get_num_new_matched_tokens(view, 0)
    sched.update_state_after_alloc(view, ([1, 2, 3, 4],), 0)
    out = FakeSchedulerOutput(num_scheduled_tokens={"a": 100})
    out.scheduled_new_reqs.append(NewReq("a", ([1, 2, 3, 4],), 0, p))
    meta = sched.build_connector_meta(StepView(out))
    saved = {(t.slots[i], t.gens[i]): 1 for t in meta.saves for i in range(len(t.slots))}
    sched.update_connector_output(OffloadWorkerMeta(saved=saved))
    assert len(sched.index) == 3
    assert len(list(sched.take_events())) == (3 if on else 0)


def test_without_vllm_hashes_nothing_is_published() -> None:
    """The tier keys such blocks by its own hash, which no router knows."""
    eng = Engine(save_mode="sync")  # FakeRequest: no block_hashes
    p = prompt(7, 100)
    eng.add("a", p)
    eng.prefill("a")
    assert all(k in eng.index for k in block_keys(p, BLOCK))
    assert list(eng.sched.take_events()) == []


def test_through_the_chain_the_node_owns_its_events_and_counts_them() -> None:
    pipeline = load_pipeline(
        {
            "version": 1,
            "nodes": {"cpu": {"plugin": "offload-cpu", "config": {"save_mode": "sync"}}},
        },
        registry=discover(),
    )
    chain = chain_for(
        pipeline, "scheduler", vllm_config=EVENTS_ON, kv_cache_config=kv_cache_config(8)
    )
    sched = chain.nodes["cpu"]
    p = prompt(8, 70)
    view = RequestView(vllm_request("a", p))
    sched.get_num_new_matched_tokens(view, 0)
    sched.update_state_after_alloc(view, ([1, 2, 3],), 0)
    out = FakeSchedulerOutput(num_scheduled_tokens={"a": 70})
    out.scheduled_new_reqs.append(NewReq("a", ([1, 2, 3],), 0, p))
    meta = sched.build_connector_meta(StepView(out))
    saved = {(t.slots[i], t.gens[i]): 1 for t in meta.saves for i in range(len(t.slots))}
    sched.update_connector_output(OffloadWorkerMeta(saved=saved))
    events = list(chain.take_events())
    assert [e.block_hashes for e in events] == [[ext(h)] for h in view.block_hashes]
    assert all(e.ownership == "cpu" and e.medium == "CPU" for e in events)
    counters = chain.take_stats()["cpu"]["counters"]
    assert counters["extra"]["events_stored"] == 2

    off = chain_for(
        pipeline, "scheduler", vllm_config=EVENTS_OFF, kv_cache_config=kv_cache_config(8)
    )
    assert off.calls["take_events"] == []


# -- two KV cache groups (vLLM's hybrid manager) ---------------------------------- #

WINDOW, NUM_BLOCKS = 64, 32


def hybrid_config(groups: int = 1) -> KVCacheConfig:
    common: dict[str, Any] = dict(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
    )
    window = SlidingWindowSpec(**common, sliding_window=WINDOW)
    kvc: KVCacheConfig = hybrid_kv_cache_config(
        window, FullAttentionSpec(**common), NUM_BLOCKS, groups
    )
    return kvc


@pytest.mark.parametrize("groups", [1, 2])
def test_hybrid_events_carry_the_group_as_vllm_does(groups: int) -> None:
    """One event per group's block, as vLLM's, also where window groups of one layout
    are one entry of the tier (``groups`` 2)."""
    kvc = hybrid_config(groups)
    cfg = OffloadCPUConfig(capacity=4 << 20, save_mode="sync", window_retention=0)
    ctx: dict[str, Any] = {"kv_cache_config": kvc, "vllm_config": EVENTS_ON}
    sched = SchedulerHalf(NodeContext("cpu", cfg, "both", "scheduler", **ctx))
    worker = WorkerHalf(NodeContext("cpu", cfg, "both", "worker", **ctx))
    region = torch.zeros(
        NUM_BLOCKS, kvc.kv_cache_groups[0].kv_cache_spec.page_size_bytes, dtype=torch.int8
    )
    layers = hybrid_layers(groups)
    kv_groups = tuple(
        KVGroup(g, "sliding_window" if g < groups else "attention", BLOCK, (name,), (0,))
        for g, name in enumerate(layers)
    )
    worker.register_kv_caches(
        CanonicalKVCaches(NUM_BLOCKS, (KVRegion(region, layers),), kv_groups)
    )
    p = prompt(9, 200)  # 6 full blocks
    req = vllm_request("a", p)
    view = RequestView(req)
    sched.get_num_new_matched_tokens(view, 0)
    ids = tuple(list(range(1 + 10 * g, 8 + 10 * g)) for g in range(groups + 1))  # windowed, full
    sched.update_state_after_alloc(view, ids, 0)
    out = FakeSchedulerOutput(num_scheduled_tokens={"a": 200})
    out.scheduled_new_reqs.append(NewReq("a", ids, 0, p))
    meta = sched.build_connector_meta(StepView(out))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    sched.update_connector_output(worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    events = list(sched.take_events())
    saved = [(g, k) for t in meta.saves for g, k in zip(t.groups, t.positions, strict=True)]
    assert sorted((e.group_idx, e.block_hashes) for e in events) == sorted(
        (g, [ext(req.block_hashes[k])]) for g, k in saved
    )
    full = [e for e in events if e.group_idx == groups]
    windowed = [e for e in events if e.group_idx < groups]
    kept = {e.block_hashes[0] for e in windowed if e.group_idx == 0}
    assert len(full) == 6 and 0 < len(kept) < 6  # the window keeps what a hit needs
    for g in range(groups):  # each window group its own events, of the same blocks
        assert {e.block_hashes[0] for e in windowed if e.group_idx == g} == kept
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in full} == {
        ("full_attention", None)
    }
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in windowed} == {
        ("sliding_window", WINDOW)
    }
    # vLLM's prefix cache names the full-attention group's blocks the same way
    order = [ext(h) for h in req.block_hashes]
    full.sort(key=lambda e: order.index(e.block_hashes[0]))
    assert stored_chain(full) == stored_chain(gpu_events(req, 6, BLOCK, BLOCK))
    # a reset removes each group's blocks under its own group
    sched.reset_cache()
    removed = list(sched.take_events())
    assert all(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in removed)
    every = range(groups + 1)
    by_group = {
        g: sorted(h for e in removed if e.group_idx == g for h in e.block_hashes) for g in every
    }
    assert by_group == {
        g: sorted(e.block_hashes[0] for e in events if e.group_idx == g) for g in every
    }
