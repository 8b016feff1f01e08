"""Fakes and a tiny vLLM-like driver for the offload-cpu unit tests.

The KV cache is real: a bf16 tensor laid out like vLLM's CPU backend
(block-outermost, all layers of a block in one row), seen through a real
``CanonicalKVCaches`` (one int8 region ``[num_blocks, bytes_per_block]``).
vLLM's ``KVCacheConfig`` dataclasses are used when vLLM is importable.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.keys import RequestKeys
from kvc_offload_cpu.scheduler import SchedulerHalf
from kvc_offload_cpu.worker import WorkerHalf

from composer import (
    CanonicalKVCaches,
    KVGroup,
    KVRegion,
    NodeContext,
    NodeRole,
    RequestView,
    StepView,
)
from composer.testing.chains import Range


def block_keys(token_ids: list[int], block_size: int, cache_salt: str = "") -> list[bytes]:
    """Keys of every full block of ``token_ids`` (a trailing partial block has none), as
    the scheduler half makes them from a request's tokens."""
    keys = RequestKeys(None)
    request = SimpleNamespace(all_token_ids=token_ids, tenant=cache_salt)
    keys.ensure(request, len(token_ids) // block_size, block_size)
    return keys.keys


def corrupt(pool: Any, slot: int, offset: int = 0) -> None:
    """Flip bits of one byte of a host-pool slot (host memory gone bad)."""
    for region in pool.pools:
        if offset < region.shape[1]:
            region[slot, offset] ^= 0x5A
            return
        offset -= region.shape[1]
    raise IndexError(offset)


BLOCK = 32
LAYERS = 2
KV_HEADS = 2
HEAD = 32
PAGE = BLOCK * KV_HEADS * 2 * HEAD * 2  # bf16: 8 KiB per layer per block
SLOT = LAYERS * PAGE


def kv_cache_config(num_blocks: int) -> Any:
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    try:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
    except ImportError:  # pragma: no cover - a machine without vLLM (a GPU check)

        class FullAttentionSpec(SimpleNamespace):  # the tier reads a spec's class name
            pass

        spec = FullAttentionSpec(block_size=BLOCK, page_size_bytes=PAGE)
        return SimpleNamespace(
            num_blocks=num_blocks,
            kv_cache_tensors=[SimpleNamespace(layers=layers)],
            kv_cache_groups=[SimpleNamespace(layer_names=layers, kv_cache_spec=spec)],
            hash_block_size=BLOCK,
        )
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16
    )
    assert spec.page_size_bytes == PAGE
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * SLOT, layers=layers, layer_stride=PAGE, block_stride=SLOT
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
        hash_block_size=BLOCK,
    )


#: The hybrid tests' two layers: a windowed one, then a full-attention one.
HYBRID_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def hybrid_layers(windowed: int = 1) -> tuple[str, ...]:
    """``windowed`` windowed layers, then a full-attention one (one group each)."""
    return tuple(f"model.layers.{i}.self_attn.attn" for i in range(windowed + 1))


def hybrid_kv_cache_config(windowed: Any, full: Any, num_blocks: int, groups: int = 1) -> Any:
    """vLLM's ``KVCacheConfig`` of ``groups`` windowed groups (one layout: vLLM splits a
    hybrid's window layers so) and a full-attention group, one layer each,
    overlaying one allocation per layer (a block id is one group's block)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    page = windowed.page_size_bytes
    layers = hybrid_layers(groups)
    specs = [windowed] * groups + [full]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * page, layers=[name], layer_stride=0, block_stride=page)
            for name in layers
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[name], kv_cache_spec=spec)
            for name, spec in zip(layers, specs, strict=True)
        ],
        hash_block_size=windowed.block_size,
    )


def canonical(
    num_blocks: int, layout: str = "block", device: str = "cpu"
) -> tuple[CanonicalKVCaches, dict[str, torch.Tensor]]:
    """A real bf16 KV cache shaped like vLLM's CPU backend and its canonical view.

    ``block``: one allocation ``[num_blocks, layers, kv_heads, block_size, 2*head]``
    (block-outermost), one region whose row holds every layer's page.
    ``layer``: ``[layers, num_blocks, ...]`` (layer-outermost), one region per layer.
    ``device``: where the cache lives (``cuda``: as on a GPU).
    """
    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    if layout == "block":
        alloc = torch.zeros(
            num_blocks, LAYERS, KV_HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16, device=device
        )
        raw = {name: alloc[:, i] for i, name in enumerate(layers)}
        regions: tuple[KVRegion, ...] = (
            KVRegion(alloc.view(torch.int8).reshape(num_blocks, SLOT), layers),
        )
    else:
        alloc = torch.zeros(
            LAYERS, num_blocks, KV_HEADS, BLOCK, 2 * HEAD, dtype=torch.bfloat16, device=device
        )
        raw = {name: alloc[i] for i, name in enumerate(layers)}
        regions = tuple(
            KVRegion(alloc[i].view(torch.int8).reshape(num_blocks, PAGE), (name,))
            for i, name in enumerate(layers)
        )
    caches = CanonicalKVCaches(
        num_blocks=num_blocks,
        regions=regions,
        groups=(KVGroup(0, "attention", BLOCK, layers, tuple(range(len(regions)))),),
    )
    return caches, raw


class Blocks:
    """Whole blocks across every region: ``blocks[i]`` reads, ``blocks[i] = row`` writes."""

    def __init__(self, caches: CanonicalKVCaches) -> None:
        self.regions = [r.tensor for r in caches.regions]

    def __getitem__(self, ids: Any) -> torch.Tensor:
        return torch.cat([r[ids] for r in self.regions], dim=-1)

    def __setitem__(self, ids: Any, value: Any) -> None:
        offset = 0
        for r in self.regions:
            w = r.shape[1]
            if isinstance(value, torch.Tensor):
                r[ids] = value[..., offset : offset + w]
            else:
                r[ids] = value
            offset += w


def content(tokens: list[int], block: int) -> torch.Tensor:
    """What a forward writes into block ``block`` given the tokens so far (deterministic)."""
    seed = int.from_bytes(
        hashlib.blake2b(repr(tokens[: (block + 1) * BLOCK]).encode(), digest_size=8).digest(),
        "little",
    )
    g = torch.Generator().manual_seed(seed & (2**63 - 1))
    return torch.randint(-128, 128, (SLOT,), generator=g, dtype=torch.int8)


@dataclass
class FakeRequest:
    """The attributes of vLLM's ``Request`` that ``RequestView`` reads."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    prompt_token_ids: list[int]


@dataclass
class CachedReqs:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class FakeSchedulerOutput:
    """The attributes of vLLM's ``SchedulerOutput`` that ``StepView`` reads."""

    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: CachedReqs = field(default_factory=CachedReqs)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)


@dataclass
class Running:
    req: FakeRequest
    view: RequestView
    block_ids: list[int]
    num_computed: int
    loaded: int  # external tokens loaded at admission


class Engine:
    """Drives a scheduler node and a worker node the way vLLM calls a connector.

    One request per step keeps it simple; ``forward`` writes deterministic
    content (a function of the tokens) into the blocks it computes, so a test
    can tell loaded bytes from computed ones.
    """

    def __init__(
        self,
        num_blocks: int = 64,
        role: NodeRole = "both",
        layout: str = "block",
        device: str = "cpu",
        **config: Any,
    ) -> None:
        config.setdefault("capacity", 64 * SLOT)
        self.config = OffloadCPUConfig(**config)
        kvc = kv_cache_config(num_blocks)
        self.sched = SchedulerHalf(
            NodeContext("cpu", self.config, role, "scheduler", kv_cache_config=kvc)
        )
        self.worker = WorkerHalf(
            NodeContext("cpu", self.config, role, "worker", kv_cache_config=kvc)
        )
        self.caches, _ = canonical(num_blocks, layout, device)
        self.region = Blocks(self.caches)
        self.worker.register_kv_caches(self.caches)
        self.free = list(range(1, num_blocks))  # block 0 is vLLM's null block
        self.running: dict[str, Running] = {}
        self.finished_pending: set[str] = set()
        self.held: set[str] = set()
        #: Each finished request's kv_transfer_params, as the tier returned them.
        self.params: dict[str, Any] = {}
        self.errors: set[int] = set()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()

    # -- vLLM-like request lifecycle ------------------------------------------ #

    def add(
        self, req_id: str, prompt: list[int], loads: tuple[Any, ...] = (), **kw: Any
    ) -> tuple[int, bool]:
        """Admit a request: lookup, allocate, update_state_after_alloc. Returns the lookup.

        ``loads``: the request's ranges as the chain plans them ((node, start,
        tokens) each, made the chain's ``Range``; another node's are what it loads
        into the request)."""
        req = FakeRequest(req_id, list(prompt), **kw)
        view = RequestView(req, tuple(Range(*load) for load in loads))
        self.sched.on_new_request(view)
        ext, is_async = self.sched.get_num_new_matched_tokens(view, 0)
        assert ext is not None
        n_blocks = -(-len(prompt) // BLOCK)
        ids = [self.free.pop(0) for _ in range(n_blocks)]
        self.region[ids] = 0  # fresh blocks hold nothing useful
        self.sched.update_state_after_alloc(view, (ids,), ext)
        self.running[req_id] = Running(req, view, ids, ext, ext)
        return ext, is_async

    def prefill(self, req_id: str, *, forward: bool = True) -> FakeSchedulerOutput:
        r = self.running[req_id]
        n = r.req.num_prompt_tokens - r.num_computed
        out = FakeSchedulerOutput(num_scheduled_tokens={req_id: n})
        out.scheduled_new_reqs.append(
            NewReq(req_id, (list(r.block_ids),), r.num_computed, list(r.req.prompt_token_ids))
        )
        self.step(out, forward=forward)
        return out

    def decode(self, req_id: str, token: int) -> None:
        """Sample ``token`` then run one decode step for it."""
        r = self.running[req_id]
        r.req.output_token_ids.append(token)
        new_ids: list[int] = []
        if r.req.num_tokens > len(r.block_ids) * BLOCK:
            new_ids = [self.free.pop(0)]
            r.block_ids += new_ids
        out = FakeSchedulerOutput(num_scheduled_tokens={req_id: 1})
        out.scheduled_cached_reqs = CachedReqs([req_id], set(), [(new_ids,)], [r.num_computed], {})
        self.step(out)

    def finish(self, req_id: str) -> bool:
        r = self.running.pop(req_id)
        hold, self.params[req_id] = self.sched.request_finished(r.view, r.block_ids)
        self.finished_pending.add(req_id)
        if hold:
            self.held.add(req_id)
        else:
            self.free += r.block_ids
        return hold

    def step(self, out: FakeSchedulerOutput | None = None, *, forward: bool = True) -> Any:
        out = out or FakeSchedulerOutput()
        out.finished_req_ids |= self.finished_pending
        self.finished_pending = set()
        meta = self.sched.build_connector_meta(StepView(out))
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv()
        if forward:
            self._forward(out)
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        self.errors |= w.get_block_ids_with_load_errors()
        wmeta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        self.sched.update_connector_output(wmeta)
        for rid in sending or ():
            self.finished_sending.add(rid)
            self.held.discard(rid)
        self.finished_recving |= set(recving or ())
        return meta

    def _forward(self, out: FakeSchedulerOutput) -> None:
        for req_id, n in out.num_scheduled_tokens.items():
            r = self.running[req_id]
            start, end = r.num_computed, r.num_computed + n
            tokens = r.req.all_token_ids
            for b in range(start // BLOCK, -(-end // BLOCK)):
                self.region[r.block_ids[b]] = content(tokens, b)
            r.num_computed = end

    @contextmanager
    def background_paused(self) -> Iterator[None]:
        """Keep the worker's background copies queued until the block ends.

        Without it a test that needs a save still in flight races the copy
        thread: on a quiet machine the copy ends inside the same step.
        """
        executor = self.worker._executor
        assert executor is not None, "no background copies in sync mode"
        gate = threading.Event()
        executor.submit(gate.wait)  # one thread: every copy queues behind it
        try:
            yield
        finally:
            gate.set()

    def settle(self, steps: int = 3) -> None:
        """Let background saves finish and their confirmations reach the scheduler."""
        for _ in range(steps):
            self.worker.drain()
            self.step()

    # -- inspection ------------------------------------------------------------ #

    def block_bytes(self, req_id: str, b: int) -> torch.Tensor:
        return self.region[self.running[req_id].block_ids[b]].clone()

    @property
    def index(self) -> Any:
        return self.sched.index

    @property
    def pool(self) -> Any:
        return self.worker.pool


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()
