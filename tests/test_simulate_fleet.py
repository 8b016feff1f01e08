"""``kvc simulate --fleet``: each router model's placement (its load terms and its cache
credit), the time model's queueing, and the command line. (The prediction against a
real fleet behind vllm-router: tests/e2e/test_fleet_e2e.py.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from composer import load_pipeline
from composer.bench.fleet import POLICIES
from composer.cli import main
from composer.simulate import SimKVGroup, SimulateError
from composer.simulate.calibrate import fit_to_rate
from composer.simulate.cost import CostModel
from composer.simulate.fleet import simulate_fleet
from composer.simulate.replay import Replay
from composer.simulate.routers import ROUTERS, FleetView, make_router, session
from composer.simulate.sweep import simulate_many
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
SLICE = ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
BLOCK = 32
#: One hash id is one block (the trace scaled 512 -> 32).
KW: dict[str, Any] = {"bytes_per_block": 4096, "block_size": BLOCK, "trace_block_tokens": BLOCK}
#: Seconds: a step costs its prompt tokens' (no fixed part, no decode), so each case's
#: times can be worked out by hand.
PLAIN = CostModel(
    request_s=0.0, step_s=0.0, prefill_token_s=0.001, load_token_s=0.0, decode_seq_s=0.0
)


TAILS = iter(range(1000, 2000))


def _turn(ids: list[int], at_ms: float = 0.0, tenant: str = "") -> TraceRequest:
    # In the trace's units (512 tokens a hash id, scaled to 32): one token past
    # the hash blocks (a partial block of its own id), so every block may be
    # served; one output token.
    return TraceRequest(len(ids) * 512 + 16, 16, (*ids, next(TAILS)), at_ms, tenant)


#: Two conversations, each turn right after the other's (turn 2 repeats turn 1 and adds).
A1, A2 = _turn([1, 2, 3, 4]), _turn([1, 2, 3, 4, 5, 6])
B1, B2 = _turn([11, 12, 13, 14]), _turn([11, 12, 13, 14, 15, 16])
TRACE = [A1, A2, B1, B2]


def _fleet(router: str, trace: list[TraceRequest] = TRACE, **kwargs: Any) -> dict[str, Any]:
    options = {"concurrency": 1, "cost": PLAIN, **KW, **kwargs}
    result = simulate_fleet(load_pipeline(PIPELINE), trace, engines=2, router=router, **options)
    return {"by_engine": result.engine_requests, "served": result.tokens_served}


# --------------------------------------------------------------------------- #
# one request at a time: the cache terms alone
# --------------------------------------------------------------------------- #


def test_round_robin_splits_each_conversation_and_its_tier_serves_nothing() -> None:
    assert _fleet("round_robin") == {"by_engine": [2, 2], "served": {"cpu": 0}}


@pytest.mark.parametrize("router", ["consistent_hash", "sticky_least_loaded"])
def test_session_policies_keep_a_conversation_on_one_engine(router: str) -> None:
    # Each second turn finds its first turn's four blocks in that engine's tier.
    result = _fleet(router)
    assert result["served"] == {"cpu": 2 * 4 * BLOCK}
    assert conversation(A1) == conversation(A2) != conversation(B1)


@pytest.mark.parametrize("router", ["cache_aware", "kv_aware-vllm", "kv_aware-tiers"])
def test_one_at_a_time_the_least_loaded_fallback_is_the_first_engine(router: str) -> None:
    # cache_aware: token-id prompts carry no text; kv_aware: nothing cached at
    # first, and then everything is on the first engine.
    assert _fleet(router) == {"by_engine": [4, 0], "served": {"cpu": 2 * 4 * BLOCK}}


def test_sticky_least_loaded_gives_new_sessions_the_engine_with_fewest() -> None:
    c1 = _turn([21, 22, 23, 24])
    result = _fleet("sticky_least_loaded", [A1, B1, c1, A2, B2])
    # Three sessions on two engines: 2 and 1, each session's turns together.
    assert sorted(result["by_engine"]) == [2, 3] and result["served"] == {"cpu": 2 * 4 * BLOCK}


def test_a_tenant_is_its_own_session() -> None:
    other = replace(A2, tenant="t2")
    assert session(A2) != session(other) and session(A1) == session(A2)


# --------------------------------------------------------------------------- #
# in flight: the load terms
# --------------------------------------------------------------------------- #


def _long(n: int) -> list[TraceRequest]:
    """``n`` unrelated requests of the same length."""
    return [_turn([100 * i + 1, 100 * i + 2, 100 * i + 3]) for i in range(1, n + 1)]


@pytest.mark.parametrize("router", ["cache_aware", "power_of_two", "kv_aware-vllm",
                                    "kv_aware-tiers", "round_robin", "sticky_least_loaded"])
def test_with_two_in_flight_load_aware_policies_use_both_engines(router: str) -> None:
    # Nothing shared: the least loaded (cache_aware, kv_aware with no credit; two
    # engines drawn and the less loaded for power_of_two; fewest sessions) is the
    # idle engine every time.
    assert _fleet(router, _long(6), concurrency=2)["by_engine"] == [3, 3]


def test_kv_aware_weighs_its_credit_against_reserved_prefill_and_requests_in_flight() -> None:
    # vllm-router 0.1.17's cost: (new prefill + prefill reserved by the engine's requests
    # not yet at their first token) x (requests in flight + 1), the least, the first of
    # equals. A1 and B1 arrive together: A1 to engine 0 (129 against 129), B1 to engine
    # 1 ((129 + 129) x 2 against 129). Later three turns of B (193 tokens) arrive
    # together; engine 1's tier credits 4 blocks x 32 tokens x 0.6 = 76.8 of each: 117
    # new there, 193 on engine 0. Tiers: 193 vs 117 -> 1; 193 vs (117 + 117) x 2 -> 0;
    # (193 + 193) x 2 vs 468 -> 1: two turns where B is. Nothing credited: 193 vs 193
    # -> 0; 772 vs 193 -> 1; 772 vs 772 -> 0: one.
    turns = [A1, B1, *(_turn([11, 12, 13, 14, 15, 16 + i], at_ms=1000.0) for i in range(3))]
    tiers = _fleet("kv_aware-tiers", turns, concurrency=None)
    assert tiers == {"by_engine": [3, 2], "served": {"cpu": 2 * 4 * BLOCK}}
    vllm = _fleet("kv_aware-vllm", turns, concurrency=None)
    assert vllm == {"by_engine": [3, 2], "served": {"cpu": 4 * BLOCK}}


def _engines(vllm_blocks: int) -> list[Replay]:
    keymaker = KeyMaker(BLOCK, BLOCK)
    groups = (SimKVGroup("attention", KW["bytes_per_block"]),)
    return [
        Replay(load_pipeline(PIPELINE), {}, keymaker, 1, KW["bytes_per_block"], vllm_blocks, groups)
        for _ in range(2)
    ]


def _choose(
    router: str, engines: list[Replay], req: TraceRequest, load: list[int],
    pending: list[int] | None = None,
) -> int:
    view = FleetView(engines, load, pending=pending or [])
    _, keys, limit = engines[0].units(req)
    view.holders[keys[0]] = set(range(len(engines)))  # every engine is asked
    return make_router(router, len(engines))(view, req, keys, limit, 0.0)


@pytest.mark.parametrize("vllm_blocks", [0, 64])
def test_kv_aware_credits_the_engine_that_holds_the_prompt(vllm_blocks: int) -> None:
    engines = _engines(vllm_blocks)
    engines[1].request(A1)  # the second engine's tier (and vLLM cache, if any) holds it
    assert _choose("kv_aware-tiers", engines, A2, [0, 0]) == 1
    # Crediting vLLM's cache only: the tier is invisible, its cache is not.
    assert _choose("kv_aware-vllm", engines, A2, [0, 0]) == (1 if vllm_blocks else 0)
    # Nothing held: the fewer requests in flight, then the less prefill reserved, then
    # the first (129 new tokens each: 129 x 4 against 129 x 2; 169 against 168).
    assert _choose("kv_aware-tiers", engines, B1, [3, 1]) == 1
    assert _choose("kv_aware-tiers", engines, B1, [1, 1]) == 0
    assert _choose("kv_aware-tiers", engines, B1, [0, 0], pending=[40, 39]) == 1


def test_kv_aware_weighs_the_credit_against_the_prefill_each_engine_has_pending() -> None:
    engines = _engines(0)
    engines[0].request(_turn([1, 2]))
    engines[1].request(A1)
    # A2 (193 tokens) is credited 2 blocks x 32 tokens x 0.6 on engine 0 (155 new) and
    # 4 x 32 x 0.6 on engine 1 (117 new).
    assert _choose("kv_aware-tiers", engines, A2, [0, 0]) == 1
    assert _choose("kv_aware-tiers", engines, A2, [0, 0], pending=[0, 37]) == 1  # 155 vs 154
    assert _choose("kv_aware-tiers", engines, A2, [0, 0], pending=[0, 38]) == 0  # equal
    assert _choose("kv_aware-tiers", engines, A2, [0, 1]) == 0  # 155 vs 117 x 2
    assert _choose("kv_aware-tiers", engines, A2, [1, 0]) == 1  # 155 x 2 vs 117
    engines[0].request(A1)  # equal credit: the less pending, then the first
    assert _choose("kv_aware-tiers", engines, A2, [0, 0], pending=[10, 9]) == 1
    assert _choose("kv_aware-tiers", engines, A2, [0, 0], pending=[9, 9]) == 0


def test_kv_aware_credits_nothing_to_a_request_with_a_cache_salt() -> None:
    engines = _engines(64)
    first, again = replace(A1, tenant="t"), replace(A2, tenant="t")
    engines[1].request(first)  # its tier and vLLM cache hold the tenant's prompt
    assert engines[1].holds(engines[1].units(again)[1], 5) == (4, 0)
    assert _choose("kv_aware-tiers", engines, again, [0, 0]) == 0  # the first of equals
    assert _choose("kv_aware-tiers", engines, A2, [0, 0]) == 0  # nobody holds it unsalted


def test_cache_aware_keeps_a_session_where_it_went_unless_the_load_is_imbalanced() -> None:
    engines = _engines(0)
    view = FleetView(engines, [0, 0])
    choose = make_router("cache_aware", 2)
    _, keys, limit = engines[0].units(A1)
    assert choose(view, A1, keys, limit, 0.0) == 0
    view.load[:] = [5, 0]
    assert choose(view, A2, keys, limit, 0.0) == 0  # its session's engine, busier or not
    assert choose(view, B1, keys, limit, 0.0) == 1  # a new session: the least loaded
    view.load[:] = [70, 5]  # 70 - 5 > 64 and 70 > 1.5 x 5: the shortest queue
    assert choose(view, A2, keys, limit, 0.0) == 1
    view.load[:] = [69, 5]
    assert choose(view, B2, keys, limit, 0.0) == 1


# --------------------------------------------------------------------------- #
# time
# --------------------------------------------------------------------------- #


def _timed(trace: list[TraceRequest], cost: CostModel, **kwargs: Any) -> Any:
    return simulate_fleet(
        load_pipeline(PIPELINE), trace, engines=1, router="round_robin", cost=cost, **KW,
        **kwargs,
    )


def test_requests_in_flight_share_the_engine_s_steps() -> None:
    # Two requests of 129 prompt tokens each (4 blocks + 1 token), 0.129 s alone.
    alone = _timed([_turn([1, 2, 3, 4])], PLAIN)
    assert alone.ttft_s[50] == pytest.approx(0.129)
    together = _timed(_long(2), PLAIN, concurrency=2)
    assert together.ttft_s[50] == pytest.approx(2 * 0.097)  # 97 tokens each, one step
    assert together.per_engine[0].mean_wait_s == pytest.approx(0.097)
    assert together.per_engine[0].max_in_flight == 2
    # A step's fixed cost is paid once for both.
    stepped = _timed(_long(2), replace(PLAIN, step_s=0.1), concurrency=2)
    assert stepped.ttft_s[50] == pytest.approx(0.1 + 2 * 0.097)
    # A token budget of 100: the first prompt and 3 of the second's, then its 94.
    budget = _timed(_long(2), replace(PLAIN, max_num_batched_tokens=100), concurrency=2)
    assert budget.ttft_s[50] == pytest.approx(0.1) and budget.ttft_s[99] == pytest.approx(0.194)
    # One request at a time (max_num_seqs 1): the second waits for the first.
    one = _timed(_long(2), replace(PLAIN, max_num_seqs=1), concurrency=2)
    assert one.ttft_s[99] == pytest.approx(2 * 0.097)
    assert one.per_engine[0].preemptions == 0


def test_arrivals_follow_the_timestamps_and_the_speedup() -> None:
    apart = [_turn([300 + i], at_ms=1000.0 * i) for i in range(3)]
    spread = _timed(apart, PLAIN)
    assert spread.per_engine[0].mean_wait_s == pytest.approx(0.0)
    assert spread.makespan_s == pytest.approx(2.033)
    packed = _timed(apart, PLAIN, speedup=1e6)  # all at once: they share the engine
    assert packed.per_engine[0].max_in_flight == 3 and packed.per_engine[0].mean_wait_s > 0


def test_decode_and_loads_count_after_the_first_token() -> None:
    cost = replace(PLAIN, decode_seq_s=0.5, load_token_s=0.0001, request_s=0.01)
    result = _timed([A1, A2], cost, concurrency=1)
    # A2: 4 blocks loaded from the tier, 2 blocks and 1 token computed, one output token.
    assert result.ttft_s[50] == pytest.approx(0.01 + 0.001 * 65 + 0.0001 * 128)
    assert result.ttft_s[99] == pytest.approx(0.01 + 0.001 * 129)  # A1: all computed
    capped = _timed([_turn([7])], replace(cost, decode_seq_s=1.0), max_output_tokens=1)
    assert capped.e2e_s[50] == capped.ttft_s[50]


# --------------------------------------------------------------------------- #
# every policy, on a slice of the real trace
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def sliced() -> list[TraceRequest]:
    return read_trace(SLICE, limit=200)


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("concurrency", [None, 4])
def test_every_policy_places_every_request_once(
    router: str, concurrency: int | None, sliced: list[TraceRequest]
) -> None:
    result = simulate_fleet(
        load_pipeline(PIPELINE), sliced, engines=3, router=router, concurrency=concurrency,
        bytes_per_block=16384, trace_block_tokens=32, vllm_cache_blocks=64,
    )
    assert sum(result.engine_requests) == len(sliced) == sum(e.requests for e in result.per_engine)
    assert result.prompt_tokens == sum(e.prompt_tokens for e in result.per_engine)
    assert sum(result.tokens_served.values()) == sum(e.tokens_served for e in result.per_engine)
    assert 0 < result.ttft_s[50] <= result.ttft_s[90] <= result.ttft_s[99]
    assert all(result.e2e_s[p] >= result.ttft_s[p] for p in (50, 90, 99))


def test_side_by_side_runs_give_what_one_by_one_gives(sliced: list[TraceRequest]) -> None:
    pipeline = load_pipeline(PIPELINE)
    common = {"engines": 4, "bytes_per_block": 16384, "trace_block_tokens": 32, "seed": 3}
    runs = [{"router": r} for r in ("random", "kv_aware-tiers", "power_of_two")]
    many = simulate_many(pipeline, sliced, runs, **common)
    one = [simulate_fleet(pipeline, sliced, **common, **run) for run in runs]  # type: ignore[arg-type]
    assert [r.as_dict() for r in many] == [r.as_dict() for r in one]


def test_random_policies_are_seeded(sliced: list[TraceRequest]) -> None:
    def by_engine(router: str, seed: int) -> list[int]:
        result = simulate_fleet(
            load_pipeline(PIPELINE), sliced, engines=4, router=router, seed=seed,
            bytes_per_block=16384, trace_block_tokens=32,
        )
        return [e.requests for e in result.per_engine]

    for router in ("random", "power_of_two"):
        assert by_engine(router, 1) == by_engine(router, 1) != by_engine(router, 2)


def test_each_tenant_is_counted_across_the_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = [A1, replace(A1, tenant="t2"), A2, replace(A2, tenant="t2")]
    result = simulate_fleet(
        load_pipeline(PIPELINE), trace, engines=2, router="round_robin", concurrency=1, **KW
    )
    assert set(result.tenants) == {"", "t2"}
    assert sum(t.requests for t in result.tenants.values()) == 4
    assert sum(t.prompt_tokens for t in result.tenants.values()) == result.prompt_tokens
    # Round robin: each tenant's second turn on the engine that ran its first (0, 1, 0, 1).
    assert all(t.tokens_served == 4 * BLOCK for t in result.tenants.values())
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    code, out, _ = _kvc(capsys, "simulate", str(PIPELINE), str(path), "--bytes-per-block",
                        "4KiB", "--trace-block-tokens", str(BLOCK), "--fleet", "2", "--router",
                        "round_robin")
    assert code == 0 and "round_robin, per tenant:" in out and "t2 " in out


def test_units_and_exact_agree(sliced: list[TraceRequest]) -> None:
    def served(exact: bool) -> float:
        return simulate_fleet(
            load_pipeline(PIPELINE), sliced, engines=2, router="kv_aware-tiers",
            bytes_per_block=16384, exact=exact,
        ).fraction_served

    assert abs(served(True) - served(False)) < 0.02


# --------------------------------------------------------------------------- #
# options and the command line
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engines": 0, "router": "round_robin"}, "--fleet must be >= 1"),
        ({"engines": 2, "router": "nope"}, "--router 'nope': one of round_robin"),
        ({"engines": 2, "router": "random", "concurrency": 0}, "--concurrency must be >= 1"),
        ({"engines": 2, "router": "random", "speedup": 0.0}, "--speedup must be"),
        ({"engines": 2, "router": "random", "speedup": float("nan")}, "--speedup must be"),
        ({"engines": 2, "router": "random", "max_output_tokens": 0}, "--max-output-tokens"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SimulateError, match=message):
        simulate_fleet(load_pipeline(PIPELINE), TRACE, **kwargs, **KW)


def test_every_policy_kvc_bench_measures_is_modelled() -> None:
    assert set(POLICIES) <= set(ROUTERS)


def _kvc(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, TRACE)
    common = ["simulate", str(PIPELINE), str(trace), "--bytes-per-block", "4KiB"]
    common += ["--trace-block-tokens", str(BLOCK)]
    code, out, err = _kvc(capsys, *common, "--fleet", "2", "--concurrency", "1")
    assert code == 0, err
    assert all(router in out for router in ROUTERS) and "TTFT p90 ms" in out
    code, out, _ = _kvc(capsys, *common, "--fleet", "2", "--router", "round_robin", "--json")
    data = json.loads(out)
    assert [r["router"] for r in data] == ["round_robin"]
    assert data[0]["requests_by_engine"] == [2, 2] and len(data[0]["per_engine"]) == 2
    assert set(data[0]["ttft_s"]) == {"p50", "p90", "p99"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--router", "round_robin"], "--router is a fleet's: give --fleet N too"),
        (["--concurrency", "2"], "--concurrency is a fleet's"),
        (["--speedup", "2"], "--speedup is a fleet's"),
        (["--max-output-tokens", "2"], "--max-output-tokens is a fleet's"),
        (["--cost", "request_s=1"], "--cost is a fleet's"),
        (["--seed", "2"], "--seed is a fleet's"),
        (["--fleet", "0"], "--fleet must be >= 1"),
        (["--fleet", "2", "--router", "nope"], "--router 'nope'"),
        (["--fleet", "2", "--concurrency", "0"], "--concurrency must be >= 1"),
        (["--fleet", "2", "--speedup", "-1"], "--speedup must be"),
        (["--fleet", "2", "--max-output-tokens", "0"], "--max-output-tokens must be >= 1"),
        (["--fleet", "2", "--cost", "nope=1"], "--cost: expected NAME=VALUE"),
        (["--fleet", "2", "--cost", "request_s"], "--cost: expected NAME=VALUE"),
        (["--fleet", "2", "--cost", "request_s=x"], "--cost request_s: not a number"),
        (["--fleet", "2", "--cost", "request_s=-1"], "--cost request_s: must be"),
        (["--fleet", "2", "--cost", "max_num_seqs=0"], "--cost max_num_seqs: must be >= 1"),
        (["--fleet", "2", "--sweep", "engines=0"], "--sweep engines: '0'"),
        (["--fleet", "2", "--sweep", "engines=two"], "--sweep engines: 'two'"),
        (["--fleet", "2", "--sweep", "nope=1,2"], "no modelled node has a config field"),
        (["--fleet", "2", "--sweep", "load_policy=x"], "--sweep load_policy: 'x'"),
        (["--sweep", "engines=1,2"], "no modelled node has a config field 'engines'"),
    ],
)
def test_every_bad_value_exits_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, TRACE)
    common = ["simulate", str(PIPELINE), str(trace), "--bytes-per-block", "4KiB"]
    code, _, err = _kvc(capsys, *common, *args)
    assert code == 2, (args, err)
    assert message in err and "Traceback" not in err


def test_a_fleet_sweep_answers_how_many_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "engines.txt"
    code, _, err = _kvc(
        capsys, "simulate", str(PIPELINE), str(SLICE), "--bytes-per-block", "16KiB",
        "--trace-block-tokens", "32", "--fleet", "2", "--router", "round_robin",
        "--router", "kv_aware-tiers", "--sweep", "engines=1,3", "--speedup", "4", "-o",
        str(out_file),
    )
    assert code == 0, err
    rows = out_file.read_text().splitlines()
    assert [r.split()[:2] for r in rows[2:]] == [
        ["1", "round_robin"], ["1", "kv_aware-tiers"], ["3", "round_robin"],
        ["3", "kv_aware-tiers"],
    ]
    assert out_file.with_suffix(".png").stat().st_size > 0
    code, out, err = _kvc(
        capsys, "simulate", str(PIPELINE), str(SLICE), "--bytes-per-block", "16KiB",
        "--trace-block-tokens", "32", "--fleet", "2", "--router", "random", "--sweep",
        "capacity=1MiB,1GiB", "--json", "-o", str(tmp_path / "cap.json"),
    )
    data = json.loads((tmp_path / "cap.json").read_text())
    assert code == 0 and data["sweep"] == "capacity" and len(data["results"]) == 2
    assert data["results"][0]["fraction_served"] < data["results"][1]["fraction_served"]


def test_multi_turn_keeps_the_conversations_that_come_back(tmp_path: Path) -> None:
    single = _turn([21, 22, 23])
    short = _turn([1])  # too short to name a conversation (2 hash ids)
    trace = [A1, single, B1, A2, short, short, B2]
    assert multi_turn(trace) == [A1, B1, A2, B2]
    path = tmp_path / "slice.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace


def _two(cost: CostModel, trace: list[TraceRequest], concurrency: int) -> Any:
    return simulate_fleet(
        load_pipeline(PIPELINE),
        trace,
        engines=2,
        router="round_robin",
        cost=cost,
        **KW,
        concurrency=concurrency,
    )


@pytest.mark.parametrize(
    ("cores", "concurrency", "factor"),
    [(0, 2, 1.0), (2, 2, 1.5), (3, 2, 1.0), (2, 1, 1.0), (1, 1, 1.5), (1, 2, 1.5)],
)
def test_engines_that_fill_the_cores_they_share_step_slower(
    cores: int, concurrency: int, factor: float
) -> None:
    # Two requests of 97 computed tokens, one on each engine: 0.097 s a prompt alone. A
    # step takes 1.5x while at least `cores` engines have requests (0: none shared).
    shared = replace(PLAIN, host_cores=cores, shared_step_factor=1.5)
    result = _two(shared, _long(2), concurrency)
    assert result.ttft_s[99] == pytest.approx(factor * 0.097)


@pytest.mark.parametrize(("cores", "taken"), [(0, 0.0), (1, 0.03), (2, 0.01), (3, 0.0)])
def test_the_router_s_cpu_is_taken_from_engines_that_fill_the_cores(
    cores: int, taken: float
) -> None:
    # Four at once, two on each engine: 0.194 s a step of two prompts. The router spends
    # 0.01 s of CPU on a request placed while at least `cores` engines have requests
    # (here the last 3, 2 or none of the 4), and each engine's step loses that
    # spread over the cores (0: the router has cores of its own).
    routed = replace(PLAIN, host_cores=cores, router_cpu_s=0.01)
    result = _two(routed, _long(4), 4)
    assert result.ttft_s[99] == pytest.approx(0.194 + taken)
    assert result.ttft_s[50] == pytest.approx(0.194 + taken)


def test_a_request_s_way_in_takes_the_factor_when_the_engines_fill_the_cores() -> None:
    # One core shared, two requests at once: the first finds it free (0.01 s in), the
    # second finds the first's engine holding it (0.02 s in); both engines' steps take
    # twice 0.097 s while they hold it.
    shared = replace(PLAIN, request_s=0.01, host_cores=1, shared_step_factor=2.0)
    result = _two(shared, _long(2), 2)
    assert (result.ttft_s[50], result.ttft_s[99]) == pytest.approx((0.204, 0.214))
    alone = _two(replace(shared, host_cores=0), _long(2), 2)
    assert (alone.ttft_s[50], alone.ttft_s[99]) == pytest.approx((0.107, 0.107))


def test_an_engine_idle_longer_than_a_request_s_way_in_takes_wake_s_to_start() -> None:
    # Round robin, one at a time: each request finds its engine idle since the request
    # before the last. One engine, one at a time: idle only for a request's way in.
    woken = replace(PLAIN, request_s=0.01, wake_s=0.005)
    alternating = _two(woken, _long(4), 1)
    assert alternating.ttft_s[99] == pytest.approx(0.01 + 0.097 + 0.005)
    # (The second engine's first request: idle since the start, longer than 0.01 s.)
    assert alternating.ttft_s[50] == pytest.approx(0.01 + 0.097 + 0.005)
    back_to_back = _timed(_long(4), woken, concurrency=1)
    assert back_to_back.ttft_s[99] == pytest.approx(0.01 + 0.097)


@pytest.mark.parametrize(
    ("name", "truth", "changes"),
    [("shared_step_factor", 1.7, {"host_cores": 2}), ("wake_s", 0.02, {})],
)
def test_a_fleet_s_costs_are_fitted_back_from_its_rate(
    name: str, truth: float, changes: dict[str, Any]
) -> None:
    trace = _long(12)
    concurrency = 4 if name == "shared_step_factor" else 1
    base = replace(PLAIN, request_s=0.01)

    def rate(cost: CostModel) -> float:
        result = _two(cost, trace, concurrency)
        return float(result.requests / result.makespan_s)

    measured = rate(replace(base, **changes, **{name: truth}))
    fitted = fit_to_rate(base, name, measured, rate, **changes)
    assert getattr(fitted, name) == pytest.approx(truth, rel=0.01)
    assert all(getattr(fitted, k) == v for k, v in changes.items())
    # A fleet as fast as its engines alone: the least; a rate of nothing: refused.
    assert getattr(fit_to_rate(base, name, 2 * rate(base), rate, **changes), name) == (
        1.0 if name == "shared_step_factor" else 0.0
    )
    with pytest.raises(SimulateError, match="a measured rate > 0"):
        fit_to_rate(base, name, 0.0, rate)
