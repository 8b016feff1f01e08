"""Capacity questions in one command: ``kvc simulate --fleet`` at a ``--rate`` (and its
``--sweep rate=``), and ``--ttft-p90-below`` (the fewest engines for a TTFT p90), with
every bad value refused before anything runs or is written."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from composer import load_pipeline
from composer.cli import main
from composer.simulate import SimulateError
from composer.simulate.capacity import _Bisection, engines_for_ttft, format_engines_needed
from composer.simulate.generate import TraceShape, generate
from composer.simulate.sweep import (
    MAX_ENGINES,
    MAX_RATE,
    check_engines,
    check_rate,
    rate_speedup,
    simulate_many,
    trace_rate,
)
from composer.trace import TraceRequest, out_of_order, read_trace, write_trace

ROOT = Path(__file__).parents[1]
PIPELINE = ROOT / "examples/fleet-cpu-events.yaml"
#: One hash id is one 32-token block (the trace scaled 512 -> 32).
KW: dict[str, Any] = {"bytes_per_block": 4096, "block_size": 32, "trace_block_tokens": 32}
CLI_KW = ["--bytes-per-block", "4KiB", "--trace-block-tokens", "32"]
#: Hash ids a request's prompt has (20 blocks of 32 tokens once scaled: 640 tokens).
BLOCKS = 20


def _spread(n: int, every_ms: float = 1000.0) -> list[TraceRequest]:
    """``n`` requests of the same length, each its own blocks (nothing to hit), ``every_ms``
    apart. (The tests hold whatever the engine's cost model: they compare runs.)"""
    return [
        TraceRequest(BLOCKS * 512, 16, tuple(range(100 * i, 100 * i + BLOCKS)), i * every_ms)
        for i in range(n)
    ]


def _kvc(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def spread(tmp_path: Path) -> Path:
    path = tmp_path / "spread.jsonl"
    write_trace(path, _spread(40))
    return path


# --------------------------------------------------------------------------- #
# every bad value of each new option: exit 2, located, nothing written
# --------------------------------------------------------------------------- #

NOT_POSITIVE = ["0", "-1", "-0.5"]
NOT_FINITE = ["nan", "inf", "-inf"]
NOT_A_NUMBER = ["", "x", "1e"]


def _bad(option: str, values: list[str], flags: list[str] | None = None) -> list[Any]:
    return [
        pytest.param([*(flags or []), f"{option}={v}"], option, id=f"{option}={v}") for v in values
    ]


BAD = [
    *_bad("--rate", [*NOT_POSITIVE, *NOT_FINITE, *NOT_A_NUMBER, "1e7", "1000001"], ["--fleet=2"]),
    *_bad("--fleet", [*NOT_POSITIVE, *NOT_FINITE, *NOT_A_NUMBER, "1.5", "4097", "100000"]),
    *_bad(
        "--sweep",
        [f"engines={v}" for v in ["0", "-1", "nan", "inf", "2.5", "x", "4097"]],
        ["--fleet=2"],
    ),
    *_bad(
        "--sweep",
        [f"rate={v}" for v in ["0", "-1", "nan", "inf", "-inf", "x", "1e7"]],
        ["--fleet=2"],
    ),
    *_bad("--sweep", ["rate=1,2,nan", "engines=1,0"], ["--fleet=2"]),
    *_bad("--ttft-p90-below", [*NOT_POSITIVE, *NOT_FINITE, *NOT_A_NUMBER], ["--fleet=4"]),
    *_bad("--fleet", ["0", "5000"], ["--ttft-p90-below=1"]),
]
#: Options that cannot go together, or alone.
CLASHES = [
    pytest.param(["--fleet=2", "--rate=2", "--speedup=2"], "--rate", id="rate+speedup"),
    pytest.param(["--fleet=2", "--rate=2", "--concurrency=2"], "--rate", id="rate+concurrency"),
    pytest.param(["--fleet=2", "--rate=2", "--sweep=rate=1,2"], "--rate", id="rate+sweep-rate"),
    pytest.param(["--fleet=2", "--speedup=2", "--sweep=rate=1"], "--speedup", id="speedup+sweep"),
    pytest.param(
        ["--fleet=2", "--concurrency=2", "--sweep=rate=1"],
        "--concurrency",
        id="concurrency+sweep-rate",
    ),
    pytest.param(
        ["--fleet=2", "--ttft-p90-below=1", "--sweep=engines=1,2"],
        "--ttft-p90-below",
        id="search+sweep",
    ),
    pytest.param(["--rate=2"], "--rate is a fleet's", id="rate-without-fleet"),
    pytest.param(["--ttft-p90-below=1"], "--ttft-p90-below is a fleet's", id="search-alone"),
    pytest.param(["--sweep=rate=1,2"], "(or engines or rate, with --fleet)", id="sweep-rate-alone"),
]


@pytest.mark.parametrize(("args", "message"), [*BAD, *CLASHES])
def test_every_bad_value_exits_2_located_with_nothing_written(
    tmp_path: Path,
    spread: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    out = tmp_path / "out.txt"
    code, stdout, err = _kvc(
        capsys, "simulate", str(PIPELINE), str(spread), *CLI_KW, *args, "-o", str(out)
    )
    assert code == 2, (args, err)
    assert message in err and "Traceback" not in err, err
    assert any(
        word in err
        for word in ("expected", "must be", "invalid", "not allowed", "give", "no modelled")
    )
    assert not out.exists() and not out.with_suffix(".png").exists()
    assert stdout == ""


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "1.5", "x", "4097", ""])
def test_a_sweeps_engine_count_names_the_value_and_the_bounds(value: str) -> None:
    with pytest.raises(
        SimulateError,
        match=f"--sweep engines: '{value}': expected >= 1 and at most {MAX_ENGINES} engines",
    ):
        check_engines(value, "--sweep engines")


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, -math.inf, MAX_RATE * 1.01])
def test_an_options_rate_names_the_value_and_the_bounds(value: float) -> None:
    with pytest.raises(
        SimulateError,
        match=rf"--rate must be a number > 0 and at most "
        rf"1,000,000 requests a second, got {value}",
    ):
        check_rate(value, "--rate")


def test_the_bounds_themselves_are_allowed() -> None:
    assert check_engines(str(MAX_ENGINES), "x") == MAX_ENGINES and check_engines(1, "x") == 1
    assert check_rate(MAX_RATE, "x") == MAX_RATE and check_rate("0.001", "x") == 0.001


def test_a_rate_needs_a_trace_whose_timestamps_span_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "at-once.jsonl"
    write_trace(path, _spread(5, every_ms=0))
    for option in ("--rate=2", "--sweep=rate=1,2"):
        code, _, err = _kvc(
            capsys,
            "simulate",
            str(PIPELINE),
            str(path),
            *CLI_KW,
            "--fleet=2",
            option,
            "-o",
            str(tmp_path / "o.txt"),
        )
        assert code == 2 and "timestamps span no time" in err and "--concurrency" in err
    assert list(tmp_path.glob("o.*")) == []


# --------------------------------------------------------------------------- #
# --rate: the trace's timestamps scaled to R requests a second
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("n", [2, 7, 40])
@pytest.mark.parametrize("every_ms", [1.0, 250.0, 3000.0])
def test_a_rates_speedup_makes_the_arrivals_span_requests_over_rate(
    n: int, every_ms: float
) -> None:
    trace = _spread(n, every_ms)
    random.Random(n).shuffle(trace)  # (any line order: the span is the earliest to the latest)
    assert trace_rate(trace) == pytest.approx(n / ((n - 1) * every_ms / 1000))
    for rate in (0.5, 3.0, 1000.0):
        span_s = (n - 1) * every_ms / 1000 / rate_speedup(rate, trace)
        assert span_s == pytest.approx(n / rate)


def _at_rate(path: Path, capsys: pytest.CaptureFixture[str], rate: str) -> dict[str, Any]:
    # As many engines as requests, round robin: each request has an engine to itself.
    code, out, err = _kvc(
        capsys,
        "simulate",
        str(PIPELINE),
        str(path),
        *CLI_KW,
        "--fleet=40",
        "--router=round_robin",
        f"--rate={rate}",
        "--json",
    )
    assert code == 0, err
    (result,) = json.loads(out)
    assert result["arrivals"].startswith(f"{rate} requests/s on average")
    return result  # type: ignore[no-any-return]


def test_a_run_at_a_rate_has_its_arrivals_span_requests_over_rate(
    spread: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The run spans the arrivals and then the last request, alone on its engine.
    runs = {rate: _at_rate(spread, capsys, rate) for rate in ("1", "4", "25")}
    for rate, result in runs.items():
        arrivals_s = 40 / float(rate)
        alone = result["e2e_s"]["p99"]
        assert result["e2e_s"]["p50"] == pytest.approx(alone)  # (every request alone)
        assert arrivals_s < result["makespan_s"] == pytest.approx(arrivals_s + alone)
    # (Their difference is the arrivals' alone, whatever a request costs.)
    assert runs["1"]["makespan_s"] - runs["25"]["makespan_s"] == pytest.approx(40 - 40 / 25)


def test_a_sweep_over_rate_has_one_row_per_value_and_router_and_its_plot(
    tmp_path: Path, spread: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rate.txt"
    code, _, err = _kvc(
        capsys,
        "simulate",
        str(PIPELINE),
        str(spread),
        *CLI_KW,
        "--fleet=2",
        "--router=round_robin",
        "--router=kv_aware-tiers",
        "--sweep=rate=1,30,1000",
        "-o",
        str(out),
    )
    assert code == 0, err
    lines = out.read_text().splitlines()
    assert "scaled to each rate" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [r[:2] for r in rows] == [
        [v, router] for v in ("1", "30", "1000") for router in ("round_robin", "kv_aware-tiers")
    ]
    p90 = {(r[0], r[1]): float(r[-2].replace(",", "")) for r in rows}
    assert p90["1", "round_robin"] < p90["1000", "round_robin"]  # (they queue)
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_trace_out_of_order_is_said_and_replayed_in_time_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _spread(20, 100.0)
    merged = [*trace[10:], *trace[:10]]  # two traces merged: each sorted, the whole not
    sorted_path, merged_path = tmp_path / "sorted.jsonl", tmp_path / "merged.jsonl"
    write_trace(sorted_path, trace)
    write_trace(merged_path, merged)
    assert out_of_order(sorted_path, read_trace(sorted_path)) is None
    assert read_trace(merged_path) == merged  # (kvc bench sends a merged trace as it is)
    runs = []
    for path in (sorted_path, merged_path):
        code, out, err = _kvc(
            capsys,
            "simulate",
            str(PIPELINE),
            str(path),
            *CLI_KW,
            "--fleet=2",
            "--router=round_robin",
            "--router=kv_aware-tiers",
            "--rate=50",
            "--json",
        )
        assert code == 0, err
        runs.append((json.loads(out), err))
    assert runs[0][0] == runs[1][0]
    assert "note" not in runs[0][1]
    assert (
        f"{merged_path}:11: timestamp 0 ms is before line 10's 1900 ms (1 line goes back "
        "in time): requests arrive in timestamp order"
    ) in runs[1][1]


# --------------------------------------------------------------------------- #
# --ttft-p90-below: the fewest engines, by bisection
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("most", [1, 2, 3, 5, 8, 13, 64, 100])
def test_the_bisection_finds_the_fewest_of_a_monotone_p90_in_log_runs(most: int) -> None:
    for needed in range(1, most + 2):  # (most + 1: more than most)
        search, runs = _Bisection(most), []
        while (n := search.next()) is not None:
            runs.append(n)
            search.record(n, n >= needed)
        assert search.high == (needed if needed <= most else None)
        assert len(runs) == len(set(runs)) <= math.ceil(math.log2(most)) + 1
        if search.high is not None:  # the answer rests on its own run and one fewer's
            assert search.high in runs and (search.high == 1 or search.high - 1 in runs)


#: 40 requests at once, round robin, up to 16 engines.
AT_ONCE = _spread(40, every_ms=0)
MOST = 16


@pytest.fixture(scope="module")
def every_count() -> dict[int, float]:
    """The TTFT p90 of :data:`AT_ONCE` with each engine count, one run each."""
    runs = [{"router": "round_robin", "engines": n} for n in range(1, MOST + 1)]
    results = simulate_many(load_pipeline(PIPELINE), AT_ONCE, runs, **KW)
    return {n: r.ttft_s[90] for n, r in zip(range(1, MOST + 1), results, strict=True)}


def _target(p90: dict[int, float]) -> tuple[float, int]:
    """A target between the p90 of some count and of one more, and the fewest that meet
    it; the p90 falls as engines are added (on this trace: the check is checked)."""
    assert all(p90[n + 1] <= p90[n] for n in range(1, MOST))
    fewer = max(n for n in range(2, MOST + 1) if p90[n] < p90[n - 1] and n <= MOST // 2 + 1)
    return (p90[fewer] + p90[fewer - 1]) / 2, fewer


def test_the_search_finds_the_fewest_engines_every_count_agrees_with(
    every_count: dict[int, float],
) -> None:
    target, fewest = _target(every_count)
    pipeline = load_pipeline(PIPELINE)
    (found,) = engines_for_ttft(pipeline, AT_ONCE, ["round_robin"], target, MOST, **KW)
    assert found.engines == fewest
    assert found.p90(fewest) == every_count[fewest] < target <= found.p90(fewest - 1)
    assert len(found.runs) <= math.ceil(math.log2(MOST)) + 1
    assert {n: found.p90(n) for n in found.runs} == {n: every_count[n] for n in found.runs}
    # A target no count meets: more than MOST, after one run.
    (short,) = engines_for_ttft(pipeline, AT_ONCE, ["round_robin"], 1e-9, MOST, **KW)
    assert short.engines is None and list(short.runs) == [MOST]
    table = format_engines_needed([found, short])
    assert f"more than {MOST}" in table and f"{1000 * every_count[MOST]:,.0f} (at {MOST})" in table


def test_on_a_generated_trace_the_answer_meets_the_target_and_one_fewer_misses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "agents.jsonl"
    write_trace(path, generate(TraceShape(requests=300, tenants=2, session_rate=4, seed=3)))
    trace = read_trace(path)
    routers = ["round_robin", "consistent_hash"]
    options = {
        "bytes_per_block": 65536,
        "block_size": 32,
        "trace_block_tokens": 32,
        "speedup": rate_speedup(40, trace),
    }
    every = simulate_many(
        load_pipeline(PIPELINE),
        trace,
        [{"router": r, "engines": n} for r in routers for n in range(1, 13)],
        **options,
    )
    p90s = [{n: every[12 * i + n - 1].ttft_s[90] for n in range(1, 13)} for i in range(2)]
    target = sorted(p90s[0].values())[6]  # (some counts meet it, some do not)
    out = tmp_path / "needed.json"
    code, _, err = _kvc(
        capsys,
        "simulate",
        str(PIPELINE),
        str(path),
        "--bytes-per-block",
        "64KiB",
        "--trace-block-tokens",
        "32",
        "--fleet=12",
        *(f"--router={r}" for r in routers),
        "--rate=40",
        f"--ttft-p90-below={target!r}",
        "--json",
        "-o",
        str(out),
    )
    assert code == 0, err
    data = json.loads(out.read_text())
    assert Path(data["plot"]).stat().st_size > 0 and data["ttft_p90_below_s"] == target
    for router, p90, answer in zip(routers, p90s, data["results"], strict=True):
        assert answer["router"] == router
        for run in answer["runs"]:  # (each run is the one-by-one run of its count)
            assert run["ttft_p90_s"] == p90[run["engines"]]
        n = answer["engines"]
        if n is None:
            assert p90[12] >= target
            continue
        assert answer["ttft_p90_s"] == p90[n] < target
        assert n == 1 or answer["one_fewer_ttft_p90_s"] == p90[n - 1] >= target
        if all(p90[k + 1] <= p90[k] for k in range(1, 12)):  # monotone: the fewest of all
            assert n == min(k for k in p90 if p90[k] < target)


def test_the_search_prints_its_table_and_writes_its_plot(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    every_count: dict[int, float],
) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "at-once.jsonl"
    write_trace(path, AT_ONCE)
    target, fewest = _target(every_count)
    code, out, err = _kvc(
        capsys,
        "simulate",
        str(PIPELINE),
        str(path),
        *CLI_KW,
        f"--fleet={MOST}",
        "--router=round_robin",
        f"--ttft-p90-below={target!r}",
    )
    assert code == 0, err
    assert "wrote kvc-simulate-sweep.png" in err
    assert (tmp_path / "kvc-simulate-sweep.png").stat().st_size > 0
    header, row = out.splitlines()[1:3]
    assert header.split()[:3] == ["router", "engines", "needed"]
    assert row.split()[:4] == [
        "round_robin",
        str(fewest),
        f"{1000 * every_count[fewest]:,.0f}",
        f"{1000 * every_count[fewest - 1]:,.0f}",
    ]
