"""``kvc simulate --fleet``: each router model's placement, on conversations built to
tell the policies apart, and its command line. (The prediction against a real
fleet behind vllm-router: tests/e2e/test_fleet_e2e.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from composer import load_pipeline
from composer.simulate import SimKVGroup, SimulateError
from composer.simulate.fleet import ROUTERS, _router, simulate_fleet
from composer.simulate.replay import _Replay
from composer.trace import (
    KeyMaker,
    TraceRequest,
    conversation,
    multi_turn,
    read_trace,
    write_trace,
)

ROOT = Path(__file__).parents[1]
PIPELINE = ROOT / "examples/fleet-cpu-events.yaml"
BLOCK = 32
#: One hash id is one block (the trace scaled 512 -> 32).
KW = {"bytes_per_block": 4096, "block_size": BLOCK, "trace_block_tokens": BLOCK}


TAILS = iter(range(1000, 2000))


def _turn(ids: list[int]) -> TraceRequest:
    # In the trace's units (512 tokens a hash id, scaled to 32): one token past
    # the hash blocks (a partial block of its own id), so every block may be
    # served; one output token.
    return TraceRequest(len(ids) * 512 + 16, 16, (*ids, next(TAILS)))


#: Two conversations, each turn right after the other's (turn 2 repeats turn 1 and adds).
A1, A2 = _turn([1, 2, 3, 4]), _turn([1, 2, 3, 4, 5, 6])
B1, B2 = _turn([11, 12, 13, 14]), _turn([11, 12, 13, 14, 15, 16])
TRACE = [A1, A2, B1, B2]


def _fleet(router: str, vllm_blocks: int = 0) -> dict[str, object]:
    result = simulate_fleet(
        load_pipeline(PIPELINE),
        TRACE,
        engines=2,
        router=router,
        vllm_cache_blocks=vllm_blocks,
        **KW,
    )
    return {"by_engine": result.engine_requests, "served": result.tokens_served}


def test_round_robin_splits_each_conversation_and_its_tier_serves_nothing() -> None:
    assert _fleet("round_robin") == {"by_engine": [2, 2], "served": {"cpu": 0}}


def test_consistent_hash_keeps_a_conversation_on_one_engine() -> None:
    # Each second turn finds its first turn's four blocks in that engine's tier.
    result = _fleet("consistent_hash")
    assert result["served"] == {"cpu": 2 * 4 * BLOCK}
    assert conversation(A1) == conversation(A2) != conversation(B1)


@pytest.mark.parametrize("router", ["cache_aware", "kv_aware-vllm", "kv_aware-tiers"])
def test_with_nothing_credited_every_request_goes_to_the_first_engine(router: str) -> None:
    # cache_aware: token-id prompts carry no text; kv_aware: nothing cached at
    # first, and then everything is on the first engine.
    assert _fleet(router) == {"by_engine": [4, 0], "served": {"cpu": 2 * 4 * BLOCK}}


def _engines(vllm_blocks: int) -> list[_Replay]:
    keymaker = KeyMaker(BLOCK, BLOCK)
    groups = (SimKVGroup("attention", KW["bytes_per_block"]),)
    return [
        _Replay(
            load_pipeline(PIPELINE), {}, keymaker, 1, KW["bytes_per_block"], vllm_blocks, groups
        )
        for _ in range(2)
    ]


@pytest.mark.parametrize("vllm_blocks", [0, 64])
def test_kv_aware_credits_the_engine_that_holds_the_prompt(vllm_blocks: int) -> None:
    engines = _engines(vllm_blocks)
    engines[1].request(A1)  # the second engine's tier (and vLLM cache, if any) holds it
    assert _router("kv_aware-tiers", engines)(1, A2) == 1
    # Crediting vLLM's cache only: the tier is invisible, its cache is not.
    assert _router("kv_aware-vllm", engines)(1, A2) == (1 if vllm_blocks else 0)
    assert _router("kv_aware-tiers", engines)(1, B1) == 0  # nothing held: the first


def test_a_longer_held_prefix_wins() -> None:
    engines = _engines(0)
    engines[0].request(_turn([1, 2]))
    engines[1].request(A1)
    assert _router("kv_aware-tiers", engines)(2, A2) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engines": 0, "router": "round_robin"}, "--fleet must be >= 1"),
        ({"engines": 2, "router": "random"}, "--router 'random': one of round_robin"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(SimulateError, match=message):
        simulate_fleet(load_pipeline(PIPELINE), TRACE, **kwargs, **KW)  # type: ignore[arg-type]


def test_multi_turn_keeps_the_conversations_that_come_back(tmp_path: Path) -> None:
    single = _turn([21, 22, 23])
    short = _turn([1])  # too short to name a conversation (2 hash ids)
    trace = [A1, single, B1, A2, short, short, B2]
    assert multi_turn(trace) == [A1, B1, A2, B2]
    path = tmp_path / "slice.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace


def _kvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "composer.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_the_command_line(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, TRACE)
    common = ["simulate", str(PIPELINE), str(trace), "--bytes-per-block", "4KiB"]
    common += ["--trace-block-tokens", str(BLOCK)]
    table = _kvc(*common, "--fleet", "2")
    assert table.returncode == 0, table.stderr
    assert all(router in table.stdout for router in ROUTERS)
    data = json.loads(_kvc(*common, "--fleet", "2", "--router", "round_robin", "--json").stdout)
    assert [r["router"] for r in data] == ["round_robin"] and data[0]["requests_by_engine"] == [
        2,
        2,
    ]
    for args, message in [
        (["--router", "round_robin"], "give --fleet N too"),
        (["--fleet", "2", "--sweep", "capacity=1GiB,2GiB"], "--sweep and --fleet"),
        (["--fleet", "0"], "--fleet must be >= 1"),
        (["--fleet", "2", "--router", "nope"], "--router 'nope'"),
    ]:
        proc = _kvc(*common, *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr
