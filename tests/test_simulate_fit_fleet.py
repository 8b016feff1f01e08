"""``kvc simulate --fleet N --fit-fleet BENCH_JSON``: what N engines add to one alone (an
idle engine's wake-up, the cores they share with the router and the clients, the
router's CPU), fitted to ``kvc bench --fleet``'s round_robin runs; hostile input refused.
(The fit against a real fleet: ``benchmarks/router_fleet.py``, which fits the same way.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from composer import load_pipeline
from composer.cli import main
from composer.simulate.cost import CALIBRATED
from composer.simulate.fleet import simulate_fleet
from composer.trace import multi_turn, read_trace, write_trace

ROOT = Path(__file__).parents[1]
PIPELINE = ROOT / "examples/fleet-cpu-events.yaml"
SLICE = ROOT / "tests/data/traces/mooncake-conversation_trace-500.jsonl"
KW: dict[str, Any] = {"bytes_per_block": 4096, "block_size": 32, "trace_block_tokens": 32}
FLAGS = ["--bytes-per-block", "4KiB", "--block-size", "32", "--trace-block-tokens", "32"]
#: What the runs are made with: the engine's calibrated costs and a fleet's own.
TRUTH = replace(
    CALIBRATED, host_cores=2, shared_step_factor=1.6, wake_s=0.003, router_cpu_s=0.001
)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fit") / "slice.jsonl"
    write_trace(path, multi_turn(read_trace(SLICE, limit=200)))
    return path


def _run(trace: Path, concurrency: int, **changes: Any) -> dict[str, Any]:
    """bench.json's round_robin run at ``concurrency``, as the fleet of TRUTH serves it."""
    result = simulate_fleet(
        load_pipeline(PIPELINE),
        read_trace(trace),
        engines=2,
        router="round_robin",
        cost=TRUTH,
        concurrency=concurrency,
        **KW,
    )
    run = {
        "config": "round_robin",
        "concurrency": concurrency,
        "requests_per_s": result.requests / result.makespan_s,
        "router_cpu_ms_per_request": 1000 * TRUTH.router_cpu_s,
    }
    return {**run, **changes}


def _file(tmp_path: Path, name: str, *runs: dict[str, Any]) -> str:
    path = tmp_path / name
    # Another policy's run beside it: not what the fit reads.
    path.write_text(json.dumps([{"config": "cache_aware", "concurrency": 0}, *runs]))
    return str(path)


def _kvc(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["simulate", str(PIPELINE), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_fleet_s_costs_are_fitted_back_from_its_round_robin_runs(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = _file(tmp_path, "c1.json", _run(trace, 1))
    four = _file(tmp_path, "c4.json", _run(trace, 4))
    args = [str(trace), "--fleet", "2", *FLAGS, "--fit-fleet", one, "--fit-fleet", four]
    code, out, err = _kvc(capsys, *args, "--cost", "host_cores=2", "--json")
    assert code == 0, err
    fitted = json.loads(out)["fitted"]
    assert fitted["host_cores"] == 2 and fitted["router_cpu_s"] == pytest.approx(0.001)
    assert fitted["wake_s"] == pytest.approx(TRUTH.wake_s, rel=0.01)
    assert fitted["shared_step_factor"] == pytest.approx(TRUTH.shared_step_factor, rel=0.01)
    # The table and the --cost line to give kvc simulate; without shared cores only the
    # wake-up is fitted, and it says so.
    code, out, err = _kvc(capsys, *args)
    assert code == 0, err
    assert "| 4 |" in out and "--cost host_cores=0,shared_step_factor=1,wake_s=0.003" in out
    assert "give --cost host_cores=C to fit shared_step_factor" in out


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ("not json", "(JSON): Expecting value: line 1 column 1"),
        ({"config": "round_robin"}, "not kvc bench's bench.json"),
        ([{"config": "cache_aware", "concurrency": 1}], "no round_robin run"),
        ([{"config": "round_robin", "requests_per_s": 5}], "concurrency: expected"),
        ([{"config": "round_robin", "concurrency": True}], "concurrency: expected"),
        ([{"config": "round_robin", "concurrency": 1}], "requests_per_s: expected a number"),
        (
            [{"config": "round_robin", "concurrency": 1, "requests_per_s": "9"}],
            "requests_per_s: expected a number",
        ),
        (
            [{"config": "round_robin", "concurrency": 1, "requests_per_s": float("nan")}],
            "requests_per_s: expected a number",
        ),
        (
            [
                {"config": "round_robin", "concurrency": 4, "requests_per_s": 9},
                {"config": "round_robin", "concurrency": 4, "requests_per_s": 9},
            ],
            "a second round_robin run at concurrency 4",
        ),
        (
            [
                {
                    "config": "round_robin",
                    "concurrency": 4,
                    "requests_per_s": 9,
                    "router_cpu_ms_per_request": -1,
                }
            ],
            "router_cpu_ms_per_request: expected a number >= 0",
        ),
        (
            [{"config": "round_robin", "concurrency": 1, "requests_per_s": 0}],
            "requests_per_s: expected a number > 0, got 0",
        ),
    ],
)
def test_a_bad_bench_file_is_a_located_error(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], runs: Any, message: str
) -> None:
    path = tmp_path / "bench.json"
    path.write_text(runs if isinstance(runs, str) else json.dumps(runs))
    code, _, err = _kvc(capsys, str(trace), "--fleet", "2", *FLAGS, "--fit-fleet", str(path))
    assert code == 2 and message in err and str(path) in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "flag",
    [
        ["--router", "round_robin"],
        ["--concurrency", "4"],
        ["--rate", "10"],
        ["--speedup", "2"],
        ["--sweep", "engines=1,2"],
        ["--ttft-p90-below", "1"],
    ],
)
def test_fit_fleet_refuses_what_the_bench_s_runs_decide(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    bench = _file(tmp_path, "c1.json", {"config": "round_robin", "concurrency": 1})
    args = [str(trace), "--fleet", "2", *FLAGS, "--fit-fleet", bench, *flag]
    code, _, err = _kvc(capsys, *args)
    assert code == 2 and f"no {flag[0]}" in err and "Traceback" not in err, err
    # Without --fleet: a fleet's option.
    code, _, err = _kvc(capsys, str(trace), *FLAGS, "--fit-fleet", bench)
    assert code == 2 and "--fit-fleet is a fleet's: give --fleet N too" in err
