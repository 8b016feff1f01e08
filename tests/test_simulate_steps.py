"""The engine model of ``kvc simulate --fleet`` (vLLM's scheduler step by step) and its
calibration: every rule of a step worked out by hand, a fit that recovers the costs
its samples came from, and hostile calibration and bench files."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from composer.simulate.calibrate import (
    FORMAT,
    Sample,
    fit,
    read_bench,
    read_calibration,
    serve,
    write_calibration,
)
from composer.simulate.cost import CALIBRATED, CostModel, parse_cost
from composer.simulate.steps import Job, StepEngine
from composer.simulate.tiers import SimKVGroup, SimulateError

#: A step: 10 ms, 1 ms a prompt token, 0.1 ms a token loaded, 2 ms a request decoding.
COST = CostModel(
    request_s=0.0, step_s=0.01, prefill_token_s=0.001, load_token_s=0.0001, decode_seq_s=0.002
)
BLOCK = 16


def _run(engine: StepEngine, jobs: list[Job]) -> list[tuple[float, str, int]]:
    """Every job queued at 0; the engine's steps to the end: (time, what, job index)."""
    for job in jobs:
        engine.add(job)
    now, seen = 0.0, []
    while (took := engine.start_step()) is not None:
        now += took
        first, done = engine.end_step()
        seen += [(round(now, 6), "first", j.index) for j in first]
        seen += [(round(now, 6), "done", j.index) for j in done]
    return seen


def test_alone_a_prompt_is_one_step_and_each_token_after_it_one_more() -> None:
    seen = _run(StepEngine(COST, BLOCK), [Job(0, 0.0, 100, 0, 0, 3)])
    # 0.01 + 100 * 0.001; then two decode steps of 0.01 + 0.002.
    assert seen == [(0.11, "first", 0), (0.134, "done", 0)]
    assert COST.alone_ttft_s(100, 0) == pytest.approx(0.11)


def test_a_prompt_over_the_token_budget_is_chunked() -> None:
    engine = StepEngine(replace(COST, max_num_batched_tokens=64), BLOCK)
    seen = _run(engine, [Job(0, 0.0, 100, 0, 0, 1)])
    assert seen[0] == (0.01 + 0.064 + 0.01 + 0.036, "first", 0)
    assert replace(COST, max_num_batched_tokens=64).alone_ttft_s(100, 0) == pytest.approx(0.12)


def test_decodes_run_first_and_a_new_prompt_shares_their_step() -> None:
    engine = StepEngine(replace(COST, max_num_batched_tokens=50), BLOCK)
    seen = _run(engine, [Job(0, 0.0, 10, 0, 0, 3), Job(1, 0.0, 100, 0, 0, 1)])
    # Step 1: job 0's prompt (10) and 40 of job 1's; step 2: job 0 decodes (1 token)
    # beside 49 more of job 1's; step 3: job 0 decodes, job 1's last 11 tokens.
    step1 = 0.01 + 0.05
    step2 = 0.01 + 0.049 + 0.002
    step3 = 0.01 + 0.011 + 0.002
    assert seen == [
        (round(step1, 6), "first", 0),
        (round(step1 + step2 + step3, 6), "first", 1),
        (round(step1 + step2 + step3, 6), "done", 0),
        (round(step1 + step2 + step3, 6), "done", 1),
    ]


def test_max_num_seqs_holds_the_queue() -> None:
    engine = StepEngine(replace(COST, max_num_seqs=1), BLOCK)
    seen = _run(engine, [Job(0, 0.0, 10, 0, 0, 2), Job(1, 0.0, 10, 0, 0, 1)])
    assert [s[1:] for s in seen] == [("first", 0), ("done", 0), ("first", 1), ("done", 1)]


def test_a_request_waits_for_kv_blocks_and_holds_the_queue_behind_it() -> None:
    # 5 blocks of 16 (and vLLM's null block): job 0 (40 tokens, 3 blocks, 4 by its
    # end) leaves too few for job 1 (3 blocks); job 2 (1 block) would fit but waits
    # behind it (FCFS).
    engine = StepEngine(replace(COST, num_gpu_blocks=6), BLOCK)
    jobs = [Job(0, 0.0, 40, 0, 0, 10), Job(1, 0.0, 40, 0, 0, 1), Job(2, 0.0, 8, 0, 0, 1)]
    seen = _run(engine, jobs)
    order = [s[1:] for s in seen]
    assert order.index(("done", 0)) < order.index(("first", 1)) < order.index(("first", 2))
    assert engine.preemptions == 0 and engine.free == 5


def test_a_full_cache_preempts_the_last_admitted_which_is_computed_again() -> None:
    # Two 30-token prompts (2 blocks each) in 4 blocks: the first decode past a block
    # needs a fifth: the last admitted is preempted, then computed again.
    engine = StepEngine(replace(COST, num_gpu_blocks=5), BLOCK)
    seen = _run(engine, [Job(0, 0.0, 30, 0, 0, 8), Job(1, 0.0, 30, 0, 0, 8)])
    assert engine.preemptions >= 1 and engine.free == 4
    assert sorted(s[1:] for s in seen) == [("done", 0), ("done", 1), ("first", 0), ("first", 1)]


def test_a_request_larger_than_the_cache_runs_alone_without_preempting_itself() -> None:
    engine = StepEngine(replace(COST, num_gpu_blocks=3), BLOCK)  # 2 blocks and the null
    seen = _run(engine, [Job(0, 0.0, 100, 0, 0, 20), Job(1, 0.0, 10, 0, 0, 1)])
    # Job 0 (7 blocks and more) runs to its end alone, computed once; then job 1.
    assert [s[1:] for s in seen] == [("first", 0), ("done", 0), ("first", 1), ("done", 1)]
    assert seen[0][0] == pytest.approx(0.11) and engine.preemptions == 0 and engine.free == 2


def test_a_window_group_takes_blocks_for_a_whole_chunk_and_keeps_its_window() -> None:
    groups = (SimKVGroup("attention", 1), SimKVGroup("sliding_window", 1, window=32))
    engine = StepEngine(replace(COST, num_gpu_blocks=101), BLOCK, groups)
    engine.add(Job(0, 0.0, 100, 0, 0, 3))
    engine.start_step()
    # The prompt in one step: 7 blocks in each group.
    assert engine.free == 100 - 14
    engine.end_step()
    engine.start_step()
    # Then the window group keeps the blocks of its last 32 tokens (4 to 6) and the
    # new token's: 3; the full group 7.
    assert engine.free == 100 - 10
    engine.end_step()
    engine.start_step()
    engine.end_step()
    assert engine.free == 100 and not engine.running
    mamba = StepEngine(replace(COST, num_gpu_blocks=101), BLOCK, (SimKVGroup("mamba", 0),))
    mamba.add(Job(0, 0.0, 100, 0, 0, 2))
    mamba.start_step()
    assert mamba.free == 99  # one block of state, whatever the length


def test_cached_tokens_are_not_computed_and_loaded_ones_cost_their_load() -> None:
    # 64 of 100 tokens from a node: 36 computed, 64 loaded in the same step.
    seen = _run(StepEngine(COST, BLOCK), [Job(0, 0.0, 100, 64, 64, 1)])
    assert seen[0][0] == pytest.approx(0.01 + 0.036 + 0.0064)
    # A prompt wholly cached still computes its last token (vLLM's rule).
    whole = _run(StepEngine(COST, BLOCK), [Job(0, 0.0, 100, 100, 0, 1)])
    assert whole[0][0] == pytest.approx(0.01 + 0.001)


def test_serve_sends_each_request_when_a_client_is_free() -> None:
    samples = [Sample(100, 0, 1, 0.0, 0.0)] * 4
    cost = replace(COST, request_s=0.005)
    one = serve(samples, 1, cost, BLOCK)
    assert one.ttft_s == pytest.approx([0.005 + 0.11] * 4)
    assert one.wall_s == pytest.approx(4 * 0.115)
    two = serve(samples, 2, cost, BLOCK)
    # Two at a time share a step: 0.01 + 0.2 each pair.
    assert two.ttft_s == pytest.approx([0.215] * 4) and two.wall_s == pytest.approx(0.43)
    # One engine at a time is never idle longer than a request's way in: no wake-up. On
    # a core it shares with the clients (host_cores 1) its steps take the factor.
    woken = serve(samples, 1, replace(cost, wake_s=1.0), BLOCK)
    assert woken.ttft_s == pytest.approx(one.ttft_s)
    shared = serve(samples, 1, replace(cost, host_cores=1, shared_step_factor=2.0), BLOCK)
    assert shared.ttft_s == pytest.approx([0.005 + 0.22] * 4)
    # The router's CPU is taken from that core only while the engine has requests: one
    # at a time never; two at a time, the second of each pair's 0.01 s (sent after the
    # first), in the step that runs them.
    routed = replace(cost, host_cores=1, router_cpu_s=0.01)
    assert serve(samples, 1, routed, BLOCK).ttft_s == pytest.approx(one.ttft_s)
    assert serve(samples, 2, routed, BLOCK).ttft_s == pytest.approx([0.225] * 4)


def _samples(cost: CostModel, concurrency: int) -> list[Sample]:
    shapes = [(c, ld, o) for c in (100, 400, 900) for ld in (0, 320, 640) for o in (1, 8)]
    inputs = [Sample(c, ld, o, 0.0, 0.0) for c, ld, o in shapes]
    run = serve(inputs, concurrency, cost, BLOCK)
    if concurrency == 1:  # (one at a time: each request's own times, in order)
        return [
            replace(s, ttft_s=t, e2e_s=e)
            for s, t, e in zip(inputs, run.ttft_s, run.e2e_s, strict=True)
        ]
    ttfts = iter(sorted(run.ttft_s))
    return [replace(s, ttft_s=next(ttfts), e2e_s=0.0) for s in inputs]


def test_a_fit_recovers_the_costs_its_samples_came_from() -> None:
    # The split of a step's cost is on the fit's grid (1/4 of the 4 ms decode step).
    truth = CostModel(
        request_s=0.004, step_s=0.001, prefill_token_s=2e-5, load_token_s=5e-6, decode_seq_s=0.003
    )
    runs = {n: _samples(truth, n) for n in (1, 4, 8)}
    walls = {n: serve(runs[n], n, truth, BLOCK).wall_s for n in runs}
    model = fit(runs, walls, replace(truth, request_s=0, step_s=0, decode_seq_s=0), BLOCK)
    for name in ("request_s", "step_s", "prefill_token_s", "load_token_s", "decode_seq_s"):
        assert getattr(model, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-9)
    with pytest.raises(SimulateError, match="one request in flight is needed"):
        fit({4: runs[4]}, walls, truth, BLOCK)
    # Prompts longer than a step's budget say nothing of one step: refused, not zeros.
    with pytest.raises(SimulateError, match="0 request\\(s\\) whose prompt fits one step"):
        fit(runs, walls, replace(truth, max_num_batched_tokens=50), BLOCK)


@pytest.mark.parametrize("busy", [0, 1, 2, 3])
@pytest.mark.parametrize("cores", [0, 1, 2, 3])
def test_engines_that_fill_the_cores_they_share_wait_for_them(cores: int, busy: int) -> None:
    # While at least `cores` engines have requests (0: none shared): a step and a
    # request's way in take the factor, and the step loses the router's CPU spread
    # over the cores; else both take their own time.
    cost = replace(CALIBRATED, request_s=0.01, host_cores=cores, shared_step_factor=1.5)
    full = 0 < cores <= busy
    assert cost.shared_step(0.1, busy, 0.02) == pytest.approx(
        0.15 + 0.02 / cores if full else 0.1
    )
    assert cost.way_in(busy) == pytest.approx(0.015 if full else 0.01)


def test_cost_names_each_field_and_checks_its_kind() -> None:
    model = parse_cost("prefill_token_s=1e-3, max_num_seqs=4, num_gpu_blocks=0")
    assert (model.prefill_token_s, model.max_num_seqs, model.num_gpu_blocks) == (1e-3, 4, 0)
    assert model.request_s == CALIBRATED.request_s


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope=1", "expected NAME=VALUE"),
        ("request_s", "expected NAME=VALUE"),
        ("request_s=x", "request_s: not a number"),
        ("request_s=-1", "request_s: must be a finite number >= 0"),
        ("request_s=nan", "request_s: must be a finite number >= 0"),
        ("request_s=inf", "request_s: must be a finite number >= 0"),
        ("max_num_seqs=0", "max_num_seqs: must be >= 1"),
        ("max_num_batched_tokens=1.5", "max_num_batched_tokens: expected a whole number"),
        ("num_gpu_blocks=-1", "num_gpu_blocks: must be >= 0"),
        ("host_cores=-1", "host_cores: must be >= 0"),
        ("host_cores=x", "host_cores: expected a whole number"),
        ("shared_step_factor=0.5", "shared_step_factor: must be a finite number >= 1.0"),
        ("shared_step_factor=inf", "shared_step_factor: must be a finite number >= 1.0"),
        ("shared_step_factor=nan", "shared_step_factor: must be a finite number >= 1.0"),
        ("shared_step_factor=x", "shared_step_factor: not a number"),
        ("wake_s=-0.001", "wake_s: must be a finite number >= 0"),
        ("router_cpu_s=-0.001", "router_cpu_s: must be a finite number >= 0"),
        ("router_cpu_s=nan", "router_cpu_s: must be a finite number >= 0"),
        ("router_cpu_s=x", "router_cpu_s: not a number"),
    ],
)
def test_a_bad_cost_is_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(SimulateError, match=message):
        parse_cost(text)


def test_a_calibration_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    shared = replace(
        CALIBRATED,
        num_gpu_blocks=80,
        host_cores=2,
        shared_step_factor=1.4,
        wake_s=0.002,
        router_cpu_s=0.001,
    )
    write_calibration(path, shared, {"tier, 1 in flight": {}})
    assert read_calibration(path) == shared
    # A file written before the fleet's costs existed: none shared, no wake, no router.
    older = {
        k: v
        for k, v in CALIBRATED.as_dict().items()
        if k not in ("host_cores", "shared_step_factor", "wake_s", "router_cpu_s")
    }
    path.write_text(json.dumps({"format": FORMAT, "cost": older}))
    assert read_calibration(path) == CALIBRATED


def _cost_fields(**changes: Any) -> dict[str, Any]:
    return {**CALIBRATED.as_dict(), **changes}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe garbage", "not a calibration file"),
        (b"{", "not a calibration file"),
        (b"[]", "not a calibration file"),
        (json.dumps({"cost": {}}).encode(), "no format"),
        (json.dumps({"format": 1, "cost": _cost_fields()}).encode(), "format: a calibration file"),
        (json.dumps({"format": FORMAT, "cost": 3}).encode(), "cost: expected a mapping"),
        (json.dumps({"format": FORMAT, "cost": {"request_s": 1}}).encode(), "missing step_s"),
        (json.dumps({"format": FORMAT, "cost": _cost_fields(extra=1)}).encode(), "unknown extra"),
        (
            json.dumps({"format": FORMAT, "cost": _cost_fields(step_s=-1)}).encode(),
            "cost.step_s: must be a finite number >= 0",
        ),
        (b'{"format": 2, "cost": {"request_s": NaN}}', "missing"),
        (
            json.dumps({"format": FORMAT, "cost": _cost_fields(step_s=True)}).encode(),
            "cost.step_s: must be a finite number >= 0",
        ),
        (
            json.dumps({"format": FORMAT, "cost": _cost_fields(max_num_seqs="x")}).encode(),
            "cost.max_num_seqs: expected a whole number",
        ),
        (
            json.dumps({"format": FORMAT, "cost": _cost_fields(shared_step_factor=0)}).encode(),
            "cost.shared_step_factor: must be a finite number >= 1.0",
        ),
    ],
)
def test_a_bad_calibration_file_is_a_located_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "calibration.json"
    path.write_bytes(content)
    with pytest.raises(SimulateError, match=message) as caught:
        read_calibration(path)
    assert str(path) in str(caught.value)
    with pytest.raises(SimulateError, match="cannot read"):
        read_calibration(tmp_path / "absent.json")


def _bench(*runs: dict[str, Any]) -> bytes:
    return json.dumps(list(runs)).encode()


RECORD = {
    "prompt_tokens": 100,
    "output_tokens": 4,
    "cached_tokens": 32,
    "ttft_s": 0.02,
    "e2e_s": 0.05,
    "error": None,
}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"nope", "not kvc bench's bench.json"),
        (b"{}", "a list of runs"),
        (_bench({"records": [], "wall_s": 1}), "run 0: concurrency: expected a run of kvc bench"),
        (_bench({"concurrency": 0, "records": [], "wall_s": 1}), "concurrency"),
        (_bench({"concurrency": True, "records": [], "wall_s": 1}), "concurrency"),
        (
            _bench(
                {"concurrency": 1, "records": [], "wall_s": 1},
                {"concurrency": 1, "records": [], "wall_s": 1},
            ),
            "a second run at concurrency 1",
        ),
        (
            _bench({"concurrency": 1, "records": [{"ttft_s": 1, "e2e_s": 2}], "wall_s": 1}),
            "records: not kvc bench's",
        ),
        (_bench({"concurrency": 1, "records": [RECORD]}), "records: not kvc bench's"),
    ],
)
def test_a_bad_bench_file_is_a_located_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bench.json"
    path.write_bytes(content)
    with pytest.raises(SimulateError, match=message) as caught:
        read_bench([path])
    assert str(path) in str(caught.value)


def test_bench_runs_are_read_by_concurrency(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    failed = {**RECORD, "error": "HTTP 500", "ttft_s": None}
    path.write_bytes(_bench({"concurrency": 1, "records": [RECORD, failed], "wall_s": 2.5}))
    runs, walls = read_bench([path])
    assert runs == {1: [Sample(68, 32, 4, 0.02, 0.05)]} and walls == {1: 2.5}
    assert not math.isnan(walls[1])


# --------------------------------------------------------------------------- #
# the commands: kvc calibrate, kvc simulate --calibration
# --------------------------------------------------------------------------- #


def _kvc(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from composer.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _bench_file(tmp_path: Path) -> Path:
    """kvc bench's bench.json of runs at 1, 2 and 4 in flight, made by the model itself."""
    truth = replace(COST, request_s=0.004, num_gpu_blocks=200)
    runs = []
    for n in (1, 2, 4):
        samples = _samples(truth, n)
        records = [
            {
                "prompt_tokens": s.computed + s.loaded,
                "output_tokens": s.output,
                "cached_tokens": s.loaded,
                "ttft_s": s.ttft_s,
                "e2e_s": s.e2e_s or s.ttft_s,
                "error": None,
            }
            for s in samples
        ]
        runs.append(
            {"concurrency": n, "records": records, "wall_s": serve(samples, n, truth, BLOCK).wall_s}
        )
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(runs))
    return path


def test_kvc_calibrate_fits_prints_and_writes_what_simulate_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "cal.json"
    code, out, err = _kvc(
        capsys,
        "calibrate",
        str(_bench_file(tmp_path)),
        "-o",
        str(out_file),
        "--block-size",
        str(BLOCK),
        "--num-gpu-blocks",
        "200",
    )
    assert code == 0, err
    assert "prefill_token_s = 0.001" in out and "| 4 |" in out
    cost = read_calibration(out_file)
    assert cost.num_gpu_blocks == 200 and cost.prefill_token_s == pytest.approx(0.001)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--block-size", "0"], "--block-size must be >= 1"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--num-gpu-blocks", "-1"], "--num-gpu-blocks must be >= 0"),
    ],
)
def test_kvc_calibrate_refuses_bad_settings_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out_file = tmp_path / "cal.json"
    code, _, err = _kvc(capsys, "calibrate", str(_bench_file(tmp_path)), "-o", str(out_file), *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert not out_file.exists()


def test_simulate_takes_a_calibration_file_and_refuses_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from composer.trace import TraceRequest, write_trace

    root = Path(__file__).parent.parent
    trace = tmp_path / "trace.jsonl"
    write_trace(
        trace, [TraceRequest(1024, 4, (1, 2), 0.0, ""), TraceRequest(1024, 4, (3, 4), 0.0, "")]
    )
    cal = tmp_path / "cal.json"
    write_calibration(cal, replace(CALIBRATED, request_s=7.0), {})
    common = [
        "simulate",
        str(root / "examples/cpu-offload.yaml"),
        str(trace),
        "--bytes-per-block",
        "4KiB",
        "--fleet",
        "1",
        "--router",
        "round_robin",
        "--json",
    ]
    code, out, err = _kvc(capsys, *common, "--calibration", str(cal))
    assert code == 0, err
    assert json.loads(out)[0]["cost"]["request_s"] == 7.0
    assert json.loads(out)[0]["ttft_s"]["p50"] > 7.0
    cal.write_text(json.dumps({"format": 1, "cost": {}}))
    code, _, err = _kvc(capsys, *common, "--calibration", str(cal))
    assert code == 2 and f"{cal}: format" in err and "Traceback" not in err
