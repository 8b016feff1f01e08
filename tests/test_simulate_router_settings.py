"""vllm-router's kv_aware settings, as ``kvc simulate --router`` and ``kvc bench --policy``
take them (``kv_aware-tiers:external=0.8,affinity=600``): the parser against hostile
text, what each setting does in the simulator's router, and the flags the bench
gives the real router."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from composer import load_pipeline
from composer.bench.fleet import NO_TIER_CREDIT, policy
from composer.bench.replay import BenchError
from composer.cli import main
from composer.simulate.replay import Replay
from composer.simulate.routers import FleetView, RouterSpec, make_router, parse_router
from composer.simulate.tiers import SimKVGroup, SimulateError
from composer.trace import KeyMaker, TraceRequest, write_trace

ROOT = Path(__file__).parent.parent
PIPELINE = ROOT / "examples/cpu-offload.yaml"
BLOCK = 32
BYTES = 4096


def _turn(ids: list[int], tenant: str = "") -> TraceRequest:
    # One hash id a block (the trace scaled 512 -> 32), one token past them.
    return TraceRequest(len(ids) * 512 + 16, 16, (*ids, 1000 + len(ids)), 0.0, tenant)


A1, A2 = _turn([1, 2, 3, 4]), _turn([1, 2, 3, 4, 5, 6])


def _engines() -> list[Replay]:
    keymaker = KeyMaker(BLOCK, BLOCK)
    groups = (SimKVGroup("attention", BYTES),)
    pipeline = load_pipeline(PIPELINE)
    return [Replay(pipeline, {}, keymaker, 1, BYTES, 0, groups) for _ in range(2)]


def _choose(
    choose: object, engines: list[Replay], req: TraceRequest, load: list[int], now: float = 0.0
) -> int:
    view = FleetView(engines, load)
    _, keys, limit = engines[0].units(req)
    view.holders[keys[0]] = {0, 1}  # every engine is asked
    return choose(view, req, keys, limit, now)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("kv_aware-tiers", RouterSpec("kv_aware-tiers")),
        ("kv_aware-tiers:external=0.8", RouterSpec("kv_aware-tiers", 0.8)),
        ("kv_aware-tiers: external = 1 , affinity = 600", RouterSpec("kv_aware-tiers", 1.0, 600)),
        ("kv_aware-vllm:affinity=1", RouterSpec("kv_aware-vllm", None, 1)),
        ("kv_aware-tiers:external=0", RouterSpec("kv_aware-tiers", 0.0)),
    ],
)
def test_settings_parse(text: str, spec: RouterSpec) -> None:
    assert parse_router(text) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope", "one of round_robin"),
        ("nope:affinity=1", "one of round_robin"),
        ("round_robin:affinity=5", "settings after ':' are a kv_aware policy's"),
        ("kv_aware-tiers:", "expected NAME=VALUE"),
        ("kv_aware-tiers:nope=1", "expected NAME=VALUE,... with NAME one of external, affinity"),
        ("kv_aware-tiers:external", "expected NAME=VALUE"),
        ("kv_aware-tiers:external=x", "external: not a number"),
        ("kv_aware-tiers:external=1.5", "external: expected 0 to 1"),
        ("kv_aware-tiers:external=-0.1", "external: expected 0 to 1"),
        ("kv_aware-tiers:external=nan", "external: expected 0 to 1"),
        ("kv_aware-tiers:external=inf", "external: expected 0 to 1"),
        ("kv_aware-tiers:external=1,external=1", "external given twice"),
        ("kv_aware-vllm:external=0.5", "kv_aware-vllm credits no tier"),
        ("kv_aware-tiers:affinity=0", "affinity: expected 1 to 31,536,000"),
        ("kv_aware-tiers:affinity=1.5", "affinity: whole seconds"),
        ("kv_aware-tiers:affinity=1e12", "affinity: expected 1 to 31,536,000"),
    ],
)
def test_bad_settings_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(SimulateError, match=message) as caught:
        parse_router(text)
    assert f"--router {text!r}" in str(caught.value)
    with pytest.raises(BenchError, match="--policy"):
        policy(text)


def test_external_is_the_credit_of_a_tier_s_block() -> None:
    engines = _engines()
    engines[1].request(A1)  # engine 1's tier holds A2's first 4 blocks (128 tokens)
    # 0.6 (vllm-router's default): 193 new on engine 0, 117 on engine 1 (x 2 requests).
    assert _choose(make_router("kv_aware-tiers", 2), engines, A2, [0, 1]) == 0
    # In full: 65 new there, x 2 = 130 < 193.
    assert _choose(make_router("kv_aware-tiers:external=1", 2), engines, A2, [0, 1]) == 1
    # Not at all: the engines are equal, the first wins.
    assert _choose(make_router("kv_aware-tiers:external=0", 2), engines, A2, [0, 0]) == 0
    assert _choose(make_router("kv_aware-tiers", 2), engines, A2, [0, 0]) == 1


def test_affinity_sends_a_session_back_to_its_engine_while_its_binding_lives() -> None:
    engines = _engines()
    choose = make_router("kv_aware-tiers:affinity=10", 2)
    assert _choose(choose, engines, A1, [0, 0], now=0.0) == 0  # bound to engine 0
    # Engine 0 is busy: by cost the next turn would go to engine 1; bound, it goes back.
    assert _choose(choose, engines, A2, [5, 0], now=5.0) == 0
    assert _choose(make_router("kv_aware-tiers", 2), engines, A2, [5, 0]) == 1
    # Each request renews the binding for 10 s: at 14 s it still holds, at 25 s not.
    assert _choose(choose, engines, A2, [5, 0], now=14.0) == 0
    assert _choose(choose, engines, A2, [5, 0], now=25.0) == 1  # by cost, bound anew
    assert _choose(choose, engines, A2, [0, 5], now=26.0) == 1
    # Another tenant's session of the same conversation is a session of its own.
    assert _choose(choose, engines, replace(A2, tenant="t"), [0, 5], now=26.0) == 0


def test_the_bench_gives_vllm_router_the_settings_flags() -> None:
    tiers = policy("kv_aware-tiers:external=1,affinity=600")
    assert tiers.args == (
        "--policy",
        "kv_aware",
        "--kv-penalty-external",
        "1",
        "--kv-aware-session-affinity-ttl-secs",
        "600",
    )
    assert tiers.kv_events and tiers.name == "kv_aware-tiers:external=1,affinity=600"
    vllm = policy("kv_aware-vllm:affinity=60")
    assert vllm.args == (
        "--policy",
        "kv_aware",
        *NO_TIER_CREDIT,
        "--kv-aware-session-affinity-ttl-secs",
        "60",
    )


def test_the_command_line_takes_settings_and_refuses_bad_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, [A1, A2])
    common = [
        "simulate",
        str(PIPELINE),
        str(trace),
        "--bytes-per-block",
        "4KiB",
        "--trace-block-tokens",
        str(BLOCK),
        "--fleet",
        "2",
        "--concurrency",
        "1",
    ]
    assert main([*common, "--router", "kv_aware-tiers:external=0.8,affinity=60"]) == 0
    assert "kv_aware-tiers:external=0.8,affinity=60" in capsys.readouterr().out
    output = tmp_path / "out.txt"
    code = main([*common, "--router", "kv_aware-tiers:external=2", "-o", str(output)])
    err = capsys.readouterr().err
    assert code == 2 and "external: expected 0 to 1" in err and "Traceback" not in err
    assert not output.exists()
