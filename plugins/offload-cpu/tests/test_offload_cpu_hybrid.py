"""offload-cpu with several KV cache groups (vLLM's hybrid manager), one kind at a time.

vLLM's own spec classes describe a two-layer model: one windowed layer (a
sliding window or a local-attention chunk of 64 tokens) and one full-attention
layer, each its own KV cache group, both groups' blocks in one shared region
as vLLM's CPU backend lays them out. A request is computed and saved, then a
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
from kvc_offload_cpu.scheduler import SchedulerHalf
from kvc_offload_cpu.worker import WorkerHalf
from offload_cpu_fakes import (
    HYBRID_LAYERS,
    FakeRequest,
    FakeSchedulerOutput,
    NewReq,
    hybrid_kv_cache_config,
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


def kv_cache_config(windowed: Any) -> KVCacheConfig:
    kvc: KVCacheConfig = hybrid_kv_cache_config(windowed, FullAttentionSpec(**COMMON), NUM_BLOCKS)
    return kvc


class Hybrid:
    """A scheduler half and a worker half over one shared region, driven like vLLM."""

    def __init__(self, kind: str, **config: Any) -> None:
        self.spec = WINDOWED[kind]
        kvc = kv_cache_config(self.spec)
        cfg = OffloadCPUConfig(capacity=4 << 20, save_mode="sync", **config)
        ctx = {"kv_cache_config": kvc}
        self.sched = SchedulerHalf(NodeContext("cpu", cfg, "both", "scheduler", **ctx))
        self.worker = WorkerHalf(NodeContext("cpu", cfg, "both", "worker", **ctx))
        page = self.spec.page_size_bytes
        self.region = torch.zeros(NUM_BLOCKS, page, dtype=torch.int8)
        groups = (
            KVGroup(0, kind, BLOCK, LAYERS[:1], (0,)),
            KVGroup(1, "attention", BLOCK, LAYERS[1:], (0,)),
        )
        self.worker.register_kv_caches(
            CanonicalKVCaches(NUM_BLOCKS, (KVRegion(self.region, LAYERS),), groups)
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


@pytest.mark.parametrize("kind", sorted(WINDOWED))
def test_a_repeat_loads_every_group_and_the_window_keeps_only_what_a_hit_needs(kind: str) -> None:
    h = Hybrid(kind)
    tokens = _prompt(200)  # 6 full blocks and a partial one
    a = RequestView(FakeRequest("a", tokens))
    assert h.sched.get_num_new_matched_tokens(a, 0) == (0, False)
    ids_a = (list(range(1, 8)), list(range(11, 18)))  # (windowed, full)
    h.sched.update_state_after_alloc(a, ids_a, 0)
    out = FakeSchedulerOutput(num_scheduled_tokens={"a": 200})
    out.scheduled_new_reqs.append(NewReq("a", ids_a, 0, tokens))
    written = {b: (b * 7) % 251 - 120 for group in ids_a for b in group}
    meta = h.step(out, written)
    saved = {(g, k) for t in meta.saves for g, k in zip(t.groups, t.positions, strict=True)}
    hit_blocks = (200 - 1) // BLOCK  # a repeat leaves one token to compute
    layout = layout_from_kv_cache_config(kv_cache_config(h.spec))
    needed = set(layout.groups[0].needed(0, hit_blocks))
    assert {k for g, k in saved if g == 1} == set(range(6))  # full attention: every block
    assert {k for g, k in saved if g == 0} == needed  # the window before the hit only
    assert len(needed) < 6
    h.sched.request_finished(a, ids_a[0])

    b = RequestView(FakeRequest("b", list(tokens)))
    assert h.sched.get_num_new_matched_tokens(b, 0) == (hit_blocks * BLOCK, False)
    # vLLM gives the windowed group null blocks where the window has left.
    ids_b = (
        [NULL_BLOCK if k not in needed and k < hit_blocks else 21 + k for k in range(7)],
        list(range(31, 38)),
    )
    h.sched.update_state_after_alloc(b, ids_b, hit_blocks * BLOCK)
    meta = h.step(FakeSchedulerOutput())
    (load,) = meta.loads
    assert NULL_BLOCK not in load.block_ids
    assert sorted(zip(load.groups, load.positions, strict=True)) == sorted(
        [(0, k) for k in needed] + [(1, k) for k in range(hit_blocks)]
    )
    for g in (0, 1):
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
