"""``kvc simulate --fleet N``: its options, and its three runs: once per router, a sweep
(of engines, a node's field, or the arrival rate), or the fewest engines for a TTFT p90
(:mod:`composer.simulate.capacity`). The simulation's modules do the work; this module
parses, checks every value before the first run, and prints."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from composer.cli.common import dump
from composer.errors import escape
from composer.pipeline import ResolvedPipeline
from composer.simulate import SimulateError
from composer.simulate.calibrate import fit_fleet, read_calibration, read_fleet_bench
from composer.simulate.capacity import (
    OPTION,
    check_target,
    engines_for_ttft,
    format_engines_needed,
    plot_engines_needed,
)
from composer.simulate.cost import CALIBRATED, CostModel, parse_cost
from composer.simulate.fleet import FleetResult
from composer.simulate.report import format_fleet, format_fleet_sweep, plot_fleet_sweep
from composer.simulate.routers import ROUTERS, check_router
from composer.simulate.sweep import (
    MAX_ENGINES,
    MAX_RATE,
    RATE,
    check_engines,
    check_rate,
    fleet_runs,
    parse_sweep,
    rate_speedup,
    simulate_many,
)
from composer.trace import TraceRequest, out_of_order

#: ``kvc simulate``'s options that only a fleet takes, and their defaults.
FLEET_ONLY = {
    "router": None,
    "concurrency": None,
    "speedup": 1.0,
    "rate": None,
    "max_output_tokens": None,
    "cost": None,
    "calibration": None,
    "seed": 0,
    "ttft_p90_below": None,
    "fit_fleet": None,
}


def add_fleet_options(p: argparse.ArgumentParser) -> None:
    """``--fleet`` and what only a fleet takes: routers, arrivals, costs, the search."""
    p.add_argument(
        "--fleet",
        type=int,
        metavar="N",
        help="N engines running the pipeline behind a router (see --router): requests and "
        f"prompt tokens served per engine and router, as kvc bench --fleet measures them "
        f"(1 to {MAX_ENGINES}); with --ttft-p90-below, the most engines to try",
    )
    p.add_argument(
        "--router",
        action="append",
        metavar="POLICY",
        help="with --fleet: round_robin, random, consistent_hash, power_of_two, "
        "sticky_least_loaded, cache_aware, kv_aware-vllm or kv_aware-tiers, modelled on "
        "vllm-router's policies, their load terms included; a kv_aware one with vllm-router's "
        "settings after a colon (kv_aware-tiers:external=1,affinity=600) (repeat for "
        "several; default: all)",
    )
    _add_arrival_options(p)
    p.add_argument(
        OPTION,
        type=float,
        metavar="SECONDS",
        help="with --fleet N: the fewest engines, 1 to N, whose TTFT p90 is below SECONDS, "
        "per router, by bisection (it assumes the p90 falls as engines are added, and "
        "checks the answer: one fewer misses); a table and a PNG plot",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int,
        metavar="N",
        help="with --fleet: cap every request's output (as kvc bench does)",
    )
    p.add_argument(
        "--calibration",
        type=Path,
        metavar="FILE",
        help="with --fleet: the engine's costs from kvc calibrate's file (default: this "
        "project's machine's, docs/simulate.md)",
    )
    p.add_argument(
        "--cost",
        metavar="NAME=VALUE,...",
        help="with --fleet: the engine model's costs and vLLM limits over the calibrated "
        "ones (request_s, step_s, prefill_token_s, load_token_s, decode_seq_s, "
        "max_num_batched_tokens, max_num_seqs, num_gpu_blocks; docs/simulate.md)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="with --fleet: the random policies' draws (default 0)"
    )
    _add_fit_option(p)


def _add_fit_option(p: argparse.ArgumentParser) -> None:
    """``--fit-fleet``: a fleet's own costs from ``kvc bench --fleet``'s runs."""
    p.add_argument(
        "--fit-fleet",
        action="append",
        type=Path,
        metavar="BENCH_JSON",
        help="with --fleet N: fit what N engines add to one alone to kvc bench --fleet N's "
        "round_robin runs of this trace (bench.json; one at --concurrency 1 fits wake_s, one "
        "with more in flight, with --cost host_cores=C, shared_step_factor beside the "
        "router's CPU), over the engine's costs (--calibration); prints them as --cost",
    )


def _add_arrival_options(p: argparse.ArgumentParser) -> None:
    """When requests arrive: with N in flight, at the timestamps sped up, or at a rate."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="with --fleet: N requests in flight, each sent when one ends, in trace order (as "
        "kvc bench --concurrency; default: at the trace's timestamps)",
    )
    group.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="with --fleet: arrivals at the trace's timestamps divided by this (default 1)",
    )
    group.add_argument(
        "--rate",
        type=float,
        metavar="R",
        help="with --fleet: R requests a second on average (> 0, at most "
        f"{MAX_RATE:,.0f}): the trace's timestamps scaled so that its arrivals span "
        "requests / R seconds; --sweep rate=R1,R2,... runs once per rate",
    )


def plot_path(args: argparse.Namespace) -> Path:
    """Where a sweep's (or a search's) plot goes: beside ``-o``, or a default name."""
    return Path(args.output).with_suffix(".png") if args.output else Path("kvc-simulate-sweep.png")


def simulate_fleet_command(
    args: argparse.Namespace,
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    kwargs: dict[str, Any],
) -> tuple[str, list[str]]:
    """The report, and each cache policy switched off (as every ``_simulate_*``)."""
    routers = args.router or list(ROUTERS)
    for router in routers:
        check_router(router)
    sweep = parse_sweep(args.sweep) if args.sweep is not None else None
    if args.fit_fleet:
        return _fit_fleet(args, pipeline, trace, kwargs), []
    common, arrivals = _common(args, trace, kwargs, sweep)
    if args.ttft_p90_below is not None:
        return _search(args, pipeline, trace, routers, common, arrivals, kwargs["trace_name"])
    if sweep is None:
        results = simulate_many(pipeline, trace, [{"router": r} for r in routers], **common)
        _label(results, arrivals)
        failures = [f"{r.router}, {line}" for r in results for line in r.policy_failures]
        text = dump([r.as_dict() for r in results]) if args.json else format_fleet(results)
        return text, failures
    name, values = sweep
    runs = fleet_runs(pipeline, name, values, routers, trace)
    results = simulate_many(pipeline, trace, runs, **common)
    _label(results, "the trace's timestamps scaled to each rate" if name == RATE else arrivals)
    png = plot_path(args)
    plot_fleet_sweep(png, name, values, routers, results, kwargs["trace_name"])
    print(f"wrote {png}", file=sys.stderr)
    failures = [  # (runs go value by value, each once per router)
        f"{name}={values[i // len(routers)]}, {r.router}, {line}"
        for i, r in enumerate(results)
        for line in r.policy_failures
    ]
    if args.json:
        return dump(
            {
                "sweep": name,
                "values": values,
                "plot": str(png),
                "results": [r.as_dict() for r in results],
            }
        ), failures
    return format_fleet_sweep(name, values, routers, results), failures


def _cost(args: argparse.Namespace) -> CostModel:
    """The engine's costs: a calibration file's or the calibrated ones, ``--cost`` over."""
    base = CALIBRATED if args.calibration is None else read_calibration(args.calibration)
    return parse_cost(args.cost, base) if args.cost is not None else base


def _common(
    args: argparse.Namespace,
    trace: Sequence[TraceRequest],
    kwargs: dict[str, Any],
    sweep: tuple[str, list[str]] | None,
) -> tuple[dict[str, Any], str | None]:
    """Every run's arguments, each option checked, and how a ``--rate`` run's arrivals
    read (None: as the simulation says)."""
    shared = (
        "bytes_per_block",
        "block_size",
        "trace_block_tokens",
        "vllm_cache_blocks",
        "groups",
        "exact",
    )
    common: dict[str, Any] = {k: kwargs[k] for k in shared if k in kwargs}
    common |= {
        "engines": check_engines(args.fleet, "--fleet"),
        "concurrency": args.concurrency,
        "speedup": args.speedup,
        "max_output_tokens": args.max_output_tokens,
        "cost": _cost(args),
        "seed": args.seed,
    }
    if args.ttft_p90_below is not None:
        check_target(args.ttft_p90_below)
        if sweep is not None:
            raise SimulateError(f"{OPTION} searches the engine count: give no --sweep with it")
    arrivals = None
    if sweep is not None and sweep[0] == RATE:
        for flag, given in (
            ("--rate", args.rate is not None),
            ("--speedup", args.speedup != 1),
            ("--concurrency", args.concurrency is not None),
        ):
            if given:
                raise SimulateError(f"--sweep rate sets the arrivals: give no {flag} with it")
    if args.rate is not None:
        rate = check_rate(args.rate, "--rate")
        common["speedup"] = rate_speedup(rate, trace)
        arrivals = f"{rate:g} requests/s on average (trace timestamps / {common['speedup']:.3g})"
    if args.concurrency is None and (note := out_of_order(args.trace, trace)):
        print(
            f"kvc: note: {escape(note)}: requests arrive in timestamp order (as kvc bench "
            "sends them)",
            file=sys.stderr,
        )
    return common, arrivals


def _fit_fleet(
    args: argparse.Namespace,
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    kwargs: dict[str, Any],
) -> str:
    """``--fit-fleet``: the fleet's costs fitted to its round_robin runs, and each run
    measured (predicted) with them."""
    for flag, given in (
        ("--router", args.router),
        ("--concurrency", args.concurrency is not None),
        ("--rate", args.rate is not None),
        ("--speedup", args.speedup != 1),
        ("--sweep", args.sweep is not None),
        (OPTION, args.ttft_p90_below is not None),
    ):
        if given:
            raise SimulateError(f"--fit-fleet replays the bench's round_robin runs: no {flag}")
    runs = read_fleet_bench(args.fit_fleet)
    common, _ = _common(args, trace, kwargs, None)
    base = common.pop("cost")

    def rate(concurrency: int, cost: CostModel) -> float:
        run = {"router": "round_robin", "concurrency": concurrency, "cost": cost}
        result = simulate_many(pipeline, trace, [run], **common)[0]
        return result.requests / result.makespan_s if result.makespan_s else 0.0

    cost = fit_fleet(base, runs, rate, base.host_cores)
    fitted = {k: getattr(cost, k) for k in ("host_cores", "shared_step_factor", "wake_s")}
    fitted["router_cpu_s"] = cost.router_cpu_s
    checked = {n: (run.requests_per_s, rate(n, cost)) for n, run in sorted(runs.items())}
    if args.json:
        return dump({"fitted": fitted, "requests_per_s": checked})
    lines = [f"fitted on round_robin ({args.fleet} engines):"]
    lines += [f"  {name} = {value:.4g}" for name, value in fitted.items()]
    if runs.keys() - {1} and not base.host_cores:
        lines.append("  (no cores shared: give --cost host_cores=C to fit shared_step_factor)")
    lines += ["", "| in flight | requests/s measured (predicted) |", "| ---: | ---: |"]
    lines += [f"| {n} | {m:.1f} ({p:.1f}) |" for n, (m, p) in checked.items()]
    given = ",".join(f"{name}={value:.4g}" for name, value in fitted.items())
    lines += ["", f"--cost {given}"]
    return "\n".join(lines)


def _label(results: Sequence[FleetResult], arrivals: str | None) -> None:
    if arrivals is not None:
        for result in results:
            result.arrivals = arrivals


def _search(
    args: argparse.Namespace,
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    routers: Sequence[str],
    common: dict[str, Any],
    arrivals: str | None,
    trace_name: str,
) -> tuple[str, list[str]]:
    """``--ttft-p90-below``: the fewest engines per router, its table and its plot."""
    found = engines_for_ttft(
        pipeline, trace, routers, args.ttft_p90_below, common.pop("engines"), **common
    )
    for answer in found:
        _label(list(answer.runs.values()), arrivals)
    png = plot_path(args)
    plot_engines_needed(png, found, trace_name)
    print(f"wrote {png}", file=sys.stderr)
    failures = [
        f"engines={n}, {f.router}, {line}"
        for f in found
        for n, r in sorted(f.runs.items())
        for line in r.policy_failures
    ]
    if args.json:
        return dump(
            {
                "ttft_p90_below_s": args.ttft_p90_below,
                "plot": str(png),
                "results": [f.as_dict() for f in found],
            }
        ), failures
    return format_engines_needed(found), failures
