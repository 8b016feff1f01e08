"""``kvc simulate``: exact hits on hand-written traces, the shipped Mooncake slices, CLI.

Hand-written traces use ``trace_block_tokens=32`` and ``block_size=32``: one
hash id is one vLLM block of 32 tokens, so every number below can be worked out
by hand. ``input_length`` stays in the trace's units (512 tokens an id).
"""

from __future__ import annotations

import json
import random
import re
import shlex
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from kvc_offload_cpu.index import BlockIndex
from kvc_offload_cpu.simulate import OffloadCPUModel, SlotCount

from composer.cli import main
from composer.controls import Retention
from composer.discovery import discover
from composer.pipeline import ResolvedPipeline
from composer.simulate import VLLM_CACHE_ID, Result, SimKVGroup, SimulateError, simulate
from composer.simulate.shape import model_shape
from composer.trace import KeyMaker, TraceRequest, read_trace, write_trace
from composer.validation import validate_text

BS = 32
SLICES = Path(__file__).parent / "data" / "traces"
CONVERSATION = SLICES / "mooncake-conversation_trace-500.jsonl"
SYNTHETIC = SLICES / "mooncake-synthetic_trace-200.jsonl"


def req(ids: Sequence[int], partial: bool = False, output_blocks: int = 0) -> TraceRequest:
    """A request over ``ids``; ``partial``: its last id is a half-full block."""
    length = 512 * len(ids) - (256 if partial else 0)
    return TraceRequest(length, 512 * output_blocks, tuple(ids))


def pipeline(nodes: str, extra: str = "") -> ResolvedPipeline:
    return validate_text(f"version: 1\nnodes:\n{nodes}{extra}", registry=discover())


def tier(name: str, blocks: int | str, extra: str = "") -> str:
    return f"  {name}:\n    plugin: offload-cpu\n    config: {{capacity: {blocks}{extra}}}\n"


def run(p: ResolvedPipeline, trace: Sequence[TraceRequest], **kw: Any) -> Result:
    kw.setdefault("bytes_per_block", 1)
    kw.setdefault("block_size", BS)
    kw.setdefault("trace_block_tokens", BS)
    return simulate(p, trace, **kw)


def node(result: Result, node_id: str) -> Any:
    return next(n for n in result.nodes if n.id == node_id)


# --------------------------------------------------------------------------- #
# semantics
# --------------------------------------------------------------------------- #


def test_hit_is_the_longest_run_of_leading_blocks() -> None:
    # Block 3 differs, so block 4 (same id, another prefix) is no hit either.
    r = run(pipeline(tier("cpu", 100)), [req([1, 2, 3, 4]), req([1, 2, 9, 4, 5])])
    cpu = node(r, "cpu")
    assert (cpu.tokens_served, cpu.served_requests, cpu.lookups) == (2 * BS, 1, 2)
    assert r.prompt_tokens == 9 * BS
    assert r.prefill_tokens_computed == 7 * BS


@pytest.mark.parametrize(
    ("second", "hit_blocks"),
    [
        (req([1, 2, 3]), 2),  # identical prompt: its last token is computed
        (req([1, 2, 3, 7], partial=True), 3),  # a partial tail: all 3 full blocks
        (req([1, 2, 3, 7]), 3),
    ],
)
def test_at_least_one_prompt_token_is_computed(second: TraceRequest, hit_blocks: int) -> None:
    r = run(pipeline(tier("cpu", 100)), [req([1, 2, 3]), second])
    assert node(r, "cpu").tokens_served == hit_blocks * BS
    assert r.prefill_tokens_computed == r.prompt_tokens - hit_blocks * BS >= 1


def test_only_full_blocks_are_cached() -> None:
    # The first request's third block is half full: stored are blocks 1 and 2.
    r = run(pipeline(tier("cpu", 100)), [req([1, 2, 3], partial=True), req([1, 2, 3, 4])])
    cpu = node(r, "cpu")
    assert cpu.tokens_served == 2 * BS
    assert cpu.blocks_saved == 2 + 2  # then the second request's blocks 3 and 4
    assert cpu.bytes_saved == 4


@pytest.mark.parametrize(("save", "saved"), [("prompt", 2), ("all", 3)])
def test_save_policy(save: str, saved: int) -> None:
    # 2 prompt blocks + 2 output blocks' worth of tokens: KV exists for all but the
    # last token, so 3 full blocks; the output's are unique to the request.
    r = run(pipeline(tier("cpu", 100, f", save: {save}")), [req([1, 2], output_blocks=2)])
    assert node(r, "cpu").blocks_saved == saved


def test_min_blocks() -> None:
    trace = [req([1, 2, 3]), req([1, 2, 4])]
    assert node(run(pipeline(tier("cpu", 100, ", min_blocks: 3")), trace), "cpu").hits == 0
    assert node(run(pipeline(tier("cpu", 100, ", min_blocks: 2")), trace), "cpu").hits == 1


def test_lru_touches_on_hit_and_evicts_like_block_index() -> None:
    trace = [
        req([1, 2, 9], partial=True),  # stores [1], [1,2]
        req([3, 4, 9], partial=True),  # stores [3], [3,4]
        req([1, 2, 5, 9], partial=True),  # hits 2, touching them; stores [1,2,5]: full
        req([6, 9], partial=True),  # [6] evicts the least recently used: [3]
        req([1, 2, 5, 8, 9], partial=True),  # hits 3 (FIFO would have evicted [1]); evicts [3,4]
    ]
    r = run(pipeline(tier("cpu", 5)), trace)
    cpu = node(r, "cpu")
    assert cpu.tokens_served == (2 + 3) * BS
    assert cpu.served_requests == 2
    assert cpu.evictions == 2
    # The same operations driven on a BlockIndex by hand evict exactly as often.
    index = BlockIndex(5)
    keymaker = KeyMaker(BS, BS)
    for t in trace:
        keys = keymaker.keys(t, keymaker.prompt_tokens(t))
        hit = 0
        for key in keys[: (keymaker.prompt_tokens(t) - 1) // BS]:
            if index.ready(key) is None:
                break
            hit += 1
        for key in keys[:hit]:
            entry = index.ready(key)
            assert entry is not None
            index.touch(entry)
        for key in keys:
            known = index.get(key)
            if known is not None:
                index.touch(known)
            else:
                new = index.allocate(key)
                assert new is not None
                index.mark_ready(new)
    assert cpu.evictions == index.evictions > 0


def test_offload_model_is_the_tiers_block_index() -> None:
    """The tier's own index, but for its free slots, counted rather than numbered (a
    replay never reads a slot's number): every decision is BlockIndex's."""
    p = pipeline(tier("cpu", 4))
    model = OffloadCPUModel(p.node("cpu").config, block_size=BS, bytes_per_block=1)
    assert type(model.index) is SlotCount and SlotCount.__bases__ == (BlockIndex,)
    own = {k for k in vars(SlotCount) if not k.startswith("__")}
    assert own == {"_number_slots", "used_slots", "allocate", "_free_slots"}
    assert model.capacity_blocks == 4


@pytest.mark.parametrize("eviction", ["lru", "arc"])
@pytest.mark.parametrize("quotas", [None, {"a": 0.5}])
def test_counted_slots_decide_as_numbered_ones(eviction: str, quotas: Any) -> None:
    """Entries of 1 to 8 slots (a unit's and a window's), two tenants, touches: the same
    entries, slots and evictions after every step, counted or numbered."""
    rng = random.Random(7)
    numbered, counted = (cls(64, eviction, quotas=quotas) for cls in (BlockIndex, SlotCount))
    for step in range(3000):
        key, tenant = rng.randrange(400).to_bytes(2, "little"), rng.choice("ab")
        for index in (numbered, counted):
            known = index.get(key)
            if known is not None:
                index.touch(known)
                continue
            entry = index.allocate(key, tenant, 1 + key[0] % 8)
            if entry is not None:
                index.mark_ready(entry)
        assert set(numbered._entries) == set(counted._entries), step
        assert numbered.used_slots == counted.used_slots, step
        assert numbered.evictions == counted.evictions, step
    assert counted.evictions > 1000


def _policy_trace() -> list[TraceRequest]:
    return [
        req([1, 2, 3, 4, 9], partial=True),  # small (4 blocks) and big hold 4 blocks
        req([1, 2, 9], partial=True),  # small serves 2 and touches them: order 3,4,1,2
        req([8, 9], partial=True),  # [8] evicts [1,2,3] from small; big keeps all
        req([1, 2, 3, 4, 5, 9], partial=True),  # small: 2 blocks, big: 4 blocks
    ]


@pytest.mark.parametrize(
    ("policy", "small", "big"), [("first_hit", 2 + 2, 0), ("longest_hit", 2, 4)]
)
def test_first_hit_and_longest_hit(policy: str, small: int, big: int) -> None:
    p = pipeline(
        tier("small", 4) + tier("big", 100),
        f"load_order: [small, big]\nsave_to: [small, big]\nload_policy: {policy}\n",
    )
    r = run(p, _policy_trace())
    assert node(r, "small").tokens_served == small * BS
    assert node(r, "big").tokens_served == big * BS
    assert node(r, "small").hits == 2 and node(r, "big").hits == 2


@pytest.mark.parametrize(
    ("policy", "small", "big"), [("first_hit", 2, 2), ("longest_hit", 0, 2 + 4), ("ranges", 2, 4)]
)
def test_ranges_serve_each_tiers_part_of_one_request(policy: str, small: int, big: int) -> None:
    p = pipeline(tier("small", 2) + tier("big", 100), f"load_policy: {policy}\n")
    trace = [
        req([1, 2, 3, 4, 9], partial=True),  # small (2 blocks) keeps [3, 4]; big all
        req([1, 2, 9], partial=True),  # big serves [1, 2]; small then holds them
        req([1, 2, 3, 4, 5, 9], partial=True),  # small holds [1, 2], big [1, 2, 3, 4]
    ]
    r = run(p, trace)
    # ranges: the last request loads [1, 2] from small and [3, 4] from big.
    assert (node(r, "small").tokens_served, node(r, "big").tokens_served) == (
        small * BS,
        big * BS,
    )


@pytest.mark.parametrize(("promote", "small_served"), [("on_hit", 4), ("never", 0)])
def test_promotion_puts_what_a_slower_tier_served_into_the_faster(
    promote: str, small_served: int
) -> None:
    p = pipeline(
        tier("small", 4, f", promote: {promote}") + tier("big", 100),
        "load_policy: ranges\nsave_to: [small, big]\n",
    )
    # big alone holds [1..4] (small was told to save nothing of it by its capacity: 4
    # blocks, filled by [5..8] after); request 3 loads it from big; with promotion
    # small then holds it, and request 4 finds it there.
    trace = [req([1, 2, 3, 4, 9], partial=True), req([5, 6, 7, 8, 9], partial=True)]
    trace += [req([1, 2, 3, 4, 10], partial=True), req([1, 2, 3, 4, 11], partial=True)]
    r = run(p, trace)
    assert node(r, "small").tokens_served == small_served * BS
    assert node(r, "big").tokens_served == (8 - small_served) * BS


@pytest.mark.parametrize(("threshold", "served"), [(1, [0, 2, 2]), (2, [0, 0, 2])])
def test_store_threshold_admits_a_block_on_its_nth_request(
    threshold: int, served: list[int]
) -> None:
    p = pipeline(tier("cpu", 100, f", store_threshold: {threshold}"))
    trace = [req([1, 2, 9], partial=True)] * 3
    hits = [run(p, trace[: i + 1]).tokens_served // BS for i in range(3)]
    assert hits == [sum(served[: i + 1]) for i in range(3)]


def test_arc_is_the_tiers_own_index() -> None:
    # One reused prompt, then a scan of one-off prompts twice the tier: LRU loses it.
    scan = [req([100 + i, 9], partial=True) for i in range(8)]
    trace = [req([1, 2, 9], partial=True)] * 2 + scan + [req([1, 2, 9], partial=True)]
    served = {
        eviction: run(pipeline(tier("cpu", 4, f", eviction: {eviction}")), trace).tokens_served
        for eviction in ("lru", "arc")
    }
    assert served == {"lru": 2 * BS, "arc": 4 * BS}


def test_vllm_prefix_cache_is_consulted_first() -> None:
    # vLLM frees a request's blocks tail first: with room for 2 it keeps [1] and [1,2];
    # the tier serves block 3 after vLLM's hit, and only that.
    trace = [req([1, 2, 3, 9], partial=True), req([1, 2, 3, 4, 9], partial=True)]
    r = run(pipeline(tier("cpu", 100)), trace, vllm_cache_blocks=2)
    vllm, cpu = node(r, VLLM_CACHE_ID), node(r, "cpu")
    assert (vllm.tokens_served, vllm.evictions) == (2 * BS, 1 + 2)
    assert (cpu.tokens_served, cpu.lookups) == (1 * BS, 2)
    assert r.tokens_served == 3 * BS
    # A vLLM cache holding everything leaves the tier nothing to serve.
    r = run(pipeline(tier("cpu", 100)), trace, vllm_cache_blocks=100)
    assert node(r, "cpu").tokens_served == 0 and node(r, VLLM_CACHE_ID).tokens_served == 3 * BS


def test_nodes_without_a_model_are_not_modelled() -> None:
    nixl = (
        "  nixl:\n    plugin: vllm\n    role: transport\n    config: {connector: NixlConnector}\n"
    )
    r = run(pipeline(tier("cpu", 100) + nixl), [req([1, 2, 9], partial=True)] * 2)
    assert not node(r, "nixl").modelled and node(r, "nixl").tokens_served == 0
    assert node(r, "cpu").tokens_served == 2 * BS


# --------------------------------------------------------------------------- #
# rescaling and units
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize(("tbt", "tokens"), [(512, 2 * 512), (64, 2 * 64), (32, 2 * 32)])
def test_trace_block_tokens_rescales(tbt: int, tokens: int, exact: bool) -> None:
    trace = [req([1, 2, 9], partial=True), req([1, 2, 3, 9], partial=True)]
    r = run(pipeline(tier("cpu", 10_000)), trace, trace_block_tokens=tbt, exact=exact)
    assert r.prompt_tokens == (2 * tbt + tbt // 2) + (3 * tbt + tbt // 2)
    assert node(r, "cpu").tokens_served == tokens
    assert r.unit_blocks == (1 if exact else tbt // BS)


def test_units_hold_whole_trace_blocks() -> None:
    # 40 blocks of 32 tokens hold two 512-token trace blocks (16 blocks each), not 2.5.
    r = run(pipeline(tier("cpu", 40)), [req([1])], trace_block_tokens=512)
    assert node(r, "cpu").capacity_blocks == 32
    assert run(pipeline(tier("cpu", 40)), [req([1])], exact=True).nodes[0].capacity_blocks == 40


# --------------------------------------------------------------------------- #
# the shipped Mooncake slices, against an independent replay
# --------------------------------------------------------------------------- #


def _reference(trace: Sequence[TraceRequest], slots: int, tbt: int) -> int:
    """Tokens served by one LRU tier of ``slots`` blocks: a plain, separate replay."""
    lru: OrderedDict[tuple[Any, ...], None] = OrderedDict()
    served = 0
    for t in trace:
        full = t.input_length // 512
        prompt = full * tbt + (t.input_length % 512) * tbt // 512
        keys = []
        for k in range(prompt // BS):
            end = (k + 1) * BS
            j = (end - 1) // tbt
            keys.append((*t.hash_ids[: j + 1], end - j * tbt) if end <= full * tbt else object())
        hit = 0
        for key in keys[: (prompt - 1) // BS]:
            if key not in lru:
                break
            hit += 1
        for key in keys[:hit]:
            lru.move_to_end(key)
        served += hit * BS
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
                continue
            if len(lru) >= slots:
                lru.popitem(last=False)
            lru[key] = None
    return served


@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC], ids=["conversation", "synthetic"])
@pytest.mark.parametrize("slots", [200, 2000, 20_000])
def test_slice_matches_an_independent_replay(path: Path, slots: int) -> None:
    trace = read_trace(path)
    expected = _reference(trace, slots, 64)
    r = run(pipeline(tier("cpu", slots)), trace, trace_block_tokens=64, exact=True)
    assert node(r, "cpu").tokens_served == expected
    assert expected > 0


def test_slice_units_are_close_to_exact() -> None:
    trace = read_trace(CONVERSATION)
    p = pipeline(tier("cpu", 100_000))
    grouped = run(p, trace, trace_block_tokens=512)
    exact = run(p, trace, trace_block_tokens=512, exact=True)
    assert exact.fraction_served > 0.1
    assert abs(grouped.fraction_served - exact.fraction_served) < 0.02


# --------------------------------------------------------------------------- #
# hybrid models: blocks per KV cache group
# --------------------------------------------------------------------------- #

GEMMA3 = {  # one sliding-window layer (64 tokens: 2 blocks) and one full-attention layer
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "dtype": "bfloat16",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_size": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 64,
}
GRANITE = {  # one mamba layer, one attention layer
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "dtype": "bfloat16",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 128,
    "layer_types": ["mamba", "attention"],
    "mamba_d_conv": 4,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 8,
}
#: One layer's 32-token block: K and V x 2 heads x 32 dims x 2 bytes x 32 tokens.
LAYER_BLOCK = 2 * 2 * 32 * 2 * BS


def config_file(tmp_path: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def test_gemma3_groups_and_slot(tmp_path: Path) -> None:
    shape = model_shape(config_file(tmp_path, GEMMA3), BS)
    assert shape.groups == (
        SimKVGroup("sliding_window", LAYER_BLOCK, 64),
        SimKVGroup("attention", LAYER_BLOCK),
    )
    assert (shape.block_size, shape.bytes_per_block) == (BS, LAYER_BLOCK)  # one group's block
    full = {**GEMMA3, "layer_types": ["full_attention"] * 2}
    assert model_shape(config_file(tmp_path, full, "full.json"), BS).groups == (
        SimKVGroup("attention", 2 * LAYER_BLOCK),
    )


def run_model(
    tmp_path: Path, config: dict[str, Any], trace: Sequence[TraceRequest], extra: str = ""
) -> Result:
    shape = model_shape(config_file(tmp_path, config), BS)
    return run(
        pipeline(tier("cpu", "1MiB", extra)),
        trace,
        bytes_per_block=shape.bytes_per_block,
        block_size=shape.block_size,
        groups=shape.groups,
    )


def test_window_group_stores_fewer_bytes_than_full_attention(tmp_path: Path) -> None:
    # 10 full prompt blocks: full attention keeps them all; the window group only the
    # two blocks a hit at the prompt's end needs (blocks 8 and 9).
    trace = [req(range(1, 12), partial=True)]
    gemma = node(run_model(tmp_path, GEMMA3, trace), "cpu")
    full = node(
        run_model(tmp_path, {**GEMMA3, "layer_types": ["full_attention"] * 2}, trace), "cpu"
    )
    assert full.bytes_saved == 10 * 2 * LAYER_BLOCK and full.window_saving is None
    assert gemma.bytes_saved == (10 + 2) * LAYER_BLOCK == gemma.bytes_saved_per_request
    assert gemma.window_saving == pytest.approx(12 / 20)


@pytest.mark.parametrize(
    ("retention", "hits"),
    [
        # Default (every 1024 tokens): only the first prompt's end is a retained point.
        (1024, [0, 10, 10, 0]),
        # Every 4 blocks: the 5-block shared prefix hits its first 4.
        (128, [0, 10, 10, 4]),
    ],
)
def test_window_model_hits(tmp_path: Path, retention: int, hits: list[int]) -> None:
    first = list(range(1, 11))
    trace = [
        req([*first, 11], partial=True),
        req([*first, 11], partial=True),  # a repeat: all 10 full blocks
        req([*first, 50, 51], partial=True),  # a follow-up turn: the first prompt's 10
        req([*first[:5], 60, 61], partial=True),  # a prefix ending between retained points
    ]
    extra = f", window_retention: {retention}"
    served = []
    for i in range(len(trace)):
        r = run_model(tmp_path, GEMMA3, trace[: i + 1], extra)
        served.append(node(r, "cpu").tokens_served // BS - sum(served))
    assert served == hits


def test_mamba_hybrid_gets_no_tier_hits(tmp_path: Path) -> None:
    r = run_model(tmp_path, GRANITE, [req([1, 2, 3], partial=True)] * 2)
    cpu = node(r, "cpu")
    assert r.block_size == 64  # vLLM grows the attention block to hold the mamba state
    assert (cpu.tokens_served, cpu.bytes_saved) == (0, 0)
    assert cpu.note.startswith("the model has mamba KV cache groups: their recurrent state")


def test_hybrid_model_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gemma, granite = config_file(tmp_path, GEMMA3), config_file(tmp_path, GRANITE, "g.json")
    pipe = tmp_path / "p.yaml"
    pipe.write_text("version: 1\nnodes:\n" + tier("cpu", "64MiB"))
    args = ["simulate", str(pipe), str(CONVERSATION), "--model-config"]
    assert main([*args, str(gemma), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cpu = out["nodes"][0]
    assert [g["kind"] for g in out["groups"]] == ["sliding_window", "attention"]
    # A 64-token window: full attention in units, the window's own blocks kept.
    assert out["unit_blocks"] == 16 and not any("every block" in n for n in out["notes"])
    assert 0.5 < cpu["window_saving"] < 0.6 and cpu["bytes_saved_per_request"] > 0
    assert main([*args, str(gemma)]) == 0
    text = capsys.readouterr().out
    assert "KV cache groups: sliding_window (window 64) 8.0KiB/block" in text
    assert "cpu: window saving 5" in text
    assert main([*args, str(granite)]) == 0
    text = capsys.readouterr().out
    assert "cpu: serves no hits: the model has mamba KV cache groups" in text
    # hma: off: vLLM runs one full-attention group of both layers, no window.
    pipe.write_text(pipe.read_text() + "hma: off\n")
    assert main([*args, str(gemma), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["groups"] == [{"kind": "attention", "block_bytes": 2 * LAYER_BLOCK, "window": 0}]
    assert out["nodes"][0]["window_saving"] is None
    assert "hybrid KV cache manager is off" in out["notes"][-1]


def test_bad_model_config(tmp_path: Path) -> None:
    bad = config_file(tmp_path, {**GEMMA3, "num_hidden_layers": 0})
    with pytest.raises(SimulateError, match=f"^{re.escape(str(bad))}: .*num_hidden_layers"):
        model_shape(bad, BS)


# --------------------------------------------------------------------------- #
# the command
# --------------------------------------------------------------------------- #


@pytest.fixture
def pipe(tmp_path: Path) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nnodes:\n" + tier("cpu", "64GiB"))
    return path


def test_json(pipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate",
            str(pipe),
            str(CONVERSATION),
            "--bytes-per-block",
            "256KiB",
            "--vllm-cache-blocks",
            "64",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["requests"] == 500 and out["bytes_per_block"] == 256 * 1024
    assert [n["id"] for n in out["nodes"]] == [VLLM_CACHE_ID, "cpu"]
    cpu = out["nodes"][1]
    assert cpu["capacity_blocks"] == 262_144 and cpu["fraction_served"] > 0
    total = out["total"]
    assert total["tokens_served"] == sum(n["tokens_served"] for n in out["nodes"])
    assert total["prefill_tokens_computed"] == out["prompt_tokens"] - total["tokens_served"]


def test_text_and_model_config(
    pipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 256,
                "torch_dtype": "bfloat16",
            }
        )
    )
    assert main(["simulate", str(pipe), str(SYNTHETIC), "--model-config", str(config)]) == 0
    out = capsys.readouterr().out
    # 2 layers x K,V x 2 heads x 64 dims x 2 bytes x 32 tokens
    assert f"of {2 * 2 * 2 * 64 * 2 * 32:,} bytes" in out
    assert "cpu    offload-cpu" in out and "prefill tokens saved" in out


def test_sweep_writes_table_and_png(pipe: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "sweep.txt"
    code = main(
        [
            "simulate",
            str(pipe),
            str(CONVERSATION),
            "--bytes-per-block",
            "256KiB",
            "--sweep",
            "capacity=16MiB,1GiB,64GiB",
            "-o",
            str(out_file),
        ]
    )
    assert code == 0
    table = out_file.read_text().splitlines()
    assert table[1].split() == ["capacity", "cpu", "total"]
    rates = [float(line.split()[1].rstrip("%")) for line in table[2:5]]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_sweep_load_policy_on_the_ranges_example(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The trace of test_ranges_serve_each_tiers_part_of_one_request; with 32 MiB
    # blocks the example's fast tier holds 2 of them, its slow one 8.
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"input_length": 512 * len(ids) - 256, "output_length": 1, "hash_ids": ids})
            + "\n"
            for ids in ([1, 2, 3, 4, 9], [1, 2, 9], [1, 2, 3, 4, 5, 9])
        )
    )
    out_file = tmp_path / "sweep.txt"
    example = str(root / "examples/tiers-ranges.yaml")
    options = ["--bytes-per-block", "32MiB", "--trace-block-tokens", "32", "--exact"]
    code = main(
        [
            "simulate",
            example,
            str(trace),
            *options,
            "--sweep",
            "load_policy=first_hit,longest_hit,ranges",
            "-o",
            str(out_file),
        ]
    )
    assert code == 0
    table = out_file.read_text().splitlines()
    assert table[1].split() == ["load_policy", "fast", "slow", "total"]
    rows = {
        line.split()[0]: [float(x.rstrip("%")) for x in line.split()[1:]] for line in table[2:5]
    }
    # first_hit serves less; longest_hit and ranges as much, ranges more of it from fast.
    assert rows["first_hit"][2] < rows["ranges"][2] == rows["longest_hit"][2]
    assert rows["ranges"][0] > rows["longest_hit"][0]
    code = main(["simulate", example, str(trace), *options, "--sweep", "load_policy=range"])
    assert code == 2
    assert "--sweep load_policy: 'range': expected one of 'first_hit'" in capsys.readouterr().err


#: A valid trace line, open for more fields.
_LINE = '{"input_length": 5, "output_length": 1, "hash_ids": [1]'


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"input_length": 512, "output_length": 1, "hash_ids": [1]}', "{oops"], ":2: not JSON"),
        (['{"input_length": 1024, "output_length": 1, "hash_ids": [1]}'], ":1: hash_ids: 1 ids"),
        (["", '{"output_length": 1, "hash_ids": [1]}'], ":2: input_length: expected an integer"),
        (["[1, 2]"], ":1: expected a JSON object"),
        (['{"input_length": 5, "output_length": -1, "hash_ids": [1]}'], ":1: output_length"),
        (['{"input_length": 5, "output_length": 1, "hash_ids": ["a"]}'], ":1: hash_ids"),
        ([], ": trace has no requests"),
        ([_LINE + ', "tenant": 7}'], ":1: tenant: expected a non-empty string"),
        ([_LINE + f', "tenant": "{"t" * 129}"}}'], ":1: tenant: expected at most 128 characters"),
        ([_LINE + ', "tenant": "a/b"}'], ":1: tenant: must not contain '@', '/'"),
        ([_LINE + ', "kv_retention": {"ttl_s": -1}}'], ":1: kv_retention.ttl_s: expected seconds"),
        ([_LINE + ', "kv_retention": [1]}'], ":1: kv_retention: expected an object"),
        ([_LINE + ', "kv_retention": {"pin": 1}}'], ":1: kv_retention.pin: expected true or false"),
    ],
)
def test_bad_trace_lines(
    pipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], message: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert main(["simulate", str(pipe), str(trace), "--bytes-per-block", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{trace}{message}"), err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "needs --bytes-per-block or --model-config"),
        (["--bytes-per-block", "lots"], "--bytes-per-block: not a size"),
        (["--bytes-per-block", "1KiB", "--sweep", "capacity"], "--sweep: expected"),
        (["--bytes-per-block", "1KiB", "--sweep", "colour=1,2"], "no modelled node"),
        (["--bytes-per-block", "1KiB", "--sweep", "capacity=0,1GiB"], "--sweep: node 'cpu'"),
        (["--model-config", "missing.json"], "cannot read model config"),
        (["--bytes-per-block", "0"], "bytes per block must be >= 1"),
        (["--bytes-per-block", "1KiB", "--block-size", "0"], "--block-size must be >= 1"),
        (["--bytes-per-block", "1KiB", "--trace-block-tokens", "0"], "--trace-block-tokens"),
        (["--bytes-per-block", "1KiB", "--vllm-cache-blocks", "-1"], "--vllm-cache-blocks"),
    ],
)
def test_usage_errors(
    pipe: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["simulate", str(pipe), str(SYNTHETIC), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_tenants_and_retention_survive_a_written_trace(tmp_path: Path) -> None:
    requests = [
        TraceRequest(1024, 8, (1, 2), 5.0, "chat", Retention(30.0, True, 2)),
        TraceRequest(1024, 8, (1, 2), 6.0, "scan", Retention(0.0, None, -1)),
        TraceRequest(1024, 8, (1, 2), 7.0),
    ]
    write_trace(tmp_path / "t.jsonl", requests)
    assert read_trace(tmp_path / "t.jsonl") == requests
    # A tenant's prefix is its own: equal hash ids, other keys (vLLM's cache_salt).
    keymaker = KeyMaker(BS, 512)
    chat, scan, plain = (keymaker.keys(r, 1024) for r in requests)
    assert not {*chat} & {*scan} and not {*chat} & {*plain}
    assert keymaker.keys(requests[0], 1024) == chat


def test_missing_trace_file(pipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.jsonl"
    assert main(["simulate", str(pipe), str(missing), "--bytes-per-block", "1KiB"]) == 2
    assert capsys.readouterr().err.startswith(f"{missing}: cannot read trace")


def test_imports_neither_torch_nor_vllm(pipe: Path, root: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out.txt")
    probe = (
        "import sys\nfrom composer.cli import main\n"
        f"assert main(['simulate', {str(pipe)!r}, {str(SYNTHETIC)!r}, '--bytes-per-block', "
        f"'1MiB', '-o', {out!r}]) == 0\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'matplotlib') "
        "if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=root, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_docs_sweep_example_runs(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (root / "docs" / "simulate.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    (block,) = [b for b in blocks if b.startswith("kvc simulate ")]
    argv = shlex.split(block.replace("\\\n", " "))[1:]
    out = argv.index("-o") + 1
    assert argv[out] == "sweep.txt"
    argv[out] = str(tmp_path / "sweep.txt")
    monkeypatch.chdir(root)
    assert main(argv) == 0
    assert (tmp_path / "sweep.png").exists()
    assert (tmp_path / "sweep.txt").read_text().startswith("fraction of prompt tokens served")


#: A window of whole trace blocks (a Gemma-3-like 1024 tokens) beside full attention.
GEMMA3_LONG = {**GEMMA3, "sliding_window": 1024}


@pytest.mark.parametrize(
    ("window", "retention", "unit"),
    [(1024, 512, 16), (512, 512, 16), (1024, 1024, 16), (64, 512, 16), (32, 0, 16),
     (1024, 0, 16), (700, 1536, 16), (1024, 256, 1), (64, 384, 1)],
)
def test_window_groups_move_in_units_unless_a_retained_point_is_inside_a_trace_block(
    tmp_path: Path, window: int, retention: int, unit: int
) -> None:
    """Any window moves in units (its own blocks kept), and window_retention 0 too; a
    retention that is not whole trace blocks has hit points inside one: exact."""
    shape = model_shape(config_file(tmp_path, {**GEMMA3, "sliding_window": window}), BS)
    r = run(
        pipeline(tier("cpu", "1MiB", f", window_retention: {retention}")),
        [req(range(1, 4))],
        bytes_per_block=shape.bytes_per_block,
        groups=shape.groups,
        trace_block_tokens=512,
    )
    assert r.unit_blocks == unit
    assert any("every block replayed" in n for n in r.notes) == (unit == 1)


@pytest.mark.parametrize("retention", [512, 1024])
def test_a_window_models_units_are_close_to_exact(tmp_path: Path, retention: int) -> None:
    trace = read_trace(CONVERSATION)
    shape = model_shape(config_file(tmp_path, GEMMA3_LONG), BS)
    p = pipeline(tier("cpu", "1GiB", f", window_retention: {retention}"))
    kw: dict[str, Any] = {"bytes_per_block": shape.bytes_per_block, "groups": shape.groups}
    grouped = run(p, trace, trace_block_tokens=512, **kw)
    exact = run(p, trace, trace_block_tokens=512, exact=True, **kw)
    assert grouped.unit_blocks == 16 and exact.fraction_served > 0.05
    assert abs(grouped.fraction_served - exact.fraction_served) < 0.02
    saving = [node(x, "cpu").window_saving for x in (grouped, exact)]
    assert saving[0] == pytest.approx(saving[1], abs=0.02)
