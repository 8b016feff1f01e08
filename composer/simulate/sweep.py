"""``kvc simulate --sweep``: one simulation per value of a config field of every
modelled node (:func:`composer.simulate.simulate` with ``overrides``), of the
pipeline's ``load_policy``, or, with ``--fleet``, of the number of ``engines``
(one fleet simulation per value and router); and several fleet simulations side
by side on the machine's cores (:func:`simulate_many`). A fleet's arrival ``rate`` (requests
a second on average) is the trace's timestamps scaled to it (:func:`rate_speedup`)."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar, get_args

from composer.pipeline import LoadPolicy, ResolvedPipeline
from composer.simulate.fleet import FleetResult, Units, simulate_fleet
from composer.simulate.replay import (
    Replay,
    Result,
    _check_options,
    simulate,
    unit_for,
)
from composer.simulate.tiers import SimKVGroup, SimulateError
from composer.trace import MOONCAKE_BLOCK_TOKENS, KeyMaker, TraceRequest

T = TypeVar("T")
#: The fleet's own sweepable fields: how many engines, and requests a second.
ENGINES = "engines"
RATE = "rate"
#: The most engines a fleet may have (each is a replay of its own, in memory).
MAX_ENGINES = 4096
#: The highest arrival rate, requests a second (a million: past any one fleet's load).
MAX_RATE = 1e6


def check_engines(value: str | int, option: str) -> int:
    """``value`` (an option's number, or a sweep's text) as an engine count, 1 to
    :data:`MAX_ENGINES`, or ``option``'s error."""
    whole = not isinstance(value, str) or value.strip().isdecimal()
    count = int(value) if whole else 0
    if not 1 <= count <= MAX_ENGINES:
        raise SimulateError(_bad(option, value, f">= 1 and at most {MAX_ENGINES} engines"))
    return count


def check_rate(value: str | float, option: str) -> float:
    """``value`` (an option's number, or a sweep's text) as requests a second, a number > 0
    and at most :data:`MAX_RATE`, or ``option``'s error."""
    try:
        rate = float(value)
    except ValueError:
        rate = math.nan
    if not 0 < rate <= MAX_RATE:  # (NaN fails both)
        raise SimulateError(
            _bad(option, value, f"a number > 0 and at most {MAX_RATE:,.0f} requests a second")
        )
    return rate


def _bad(option: str, value: object, expected: str) -> str:
    """An option's error (``--fleet must be ..., got 0``) or a sweep value's (``--sweep
    engines: '0': expected ...``)."""
    if isinstance(value, str):
        return f"{option}: {value!r}: expected {expected}"
    return f"{option} must be {expected}, got {value}"


def trace_rate(trace: Sequence[TraceRequest]) -> float:
    """The trace's own mean arrival rate: its requests over the span of its timestamps
    (the earliest to the latest, in any line order), requests a second."""
    stamps = [r.timestamp_ms for r in trace]
    span_s = (max(stamps) - min(stamps)) / 1000.0 if stamps else 0.0
    if span_s <= 0:
        raise SimulateError(
            "--rate: the trace's timestamps span no time (every request at one moment): "
            "there is no rate to scale; give --concurrency N instead"
        )
    return len(trace) / span_s


def rate_speedup(rate: float, trace: Sequence[TraceRequest]) -> float:
    """The ``speedup`` (the divisor of the trace's timestamps) that brings ``trace`` to
    ``rate`` requests a second on average: its arrivals then span ``len(trace) / rate``
    seconds."""
    return rate / trace_rate(trace)


def parse_sweep(text: str) -> tuple[str, list[str]]:
    name, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name.strip() or not items:
        raise SimulateError(f"--sweep: expected FIELD=V1,V2,..., got {text!r}")
    return name.strip(), items


def points(
    pipeline: ResolvedPipeline,
    field_name: str,
    values: Sequence[str],
    *,
    fleet: bool = False,
    trace: Sequence[TraceRequest] = (),
) -> list[dict[str, Any]]:
    """Each value's arguments to the simulation (a pipeline, overrides, engines, or the
    speedup of a ``rate`` on ``trace``), every value checked first."""
    if field_name == ENGINES and fleet:
        return [{"engines": check_engines(v, "--sweep engines")} for v in values]
    if field_name == RATE and fleet:
        rates = [check_rate(v, "--sweep rate") for v in values]
        return [{"speedup": rate_speedup(rate, trace)} for rate in rates]
    if field_name == "load_policy":
        allowed = get_args(LoadPolicy)
        bad = [v for v in values if v not in allowed]
        if bad:
            raise SimulateError(
                f"--sweep load_policy: {', '.join(map(repr, bad))}: expected one of "
                + ", ".join(map(repr, allowed))
            )
        return [{"pipeline": dataclasses.replace(pipeline, load_policy=v)} for v in values]  # type: ignore[arg-type]
    touched = [
        n.id for n in pipeline.nodes
        if getattr(n.plugin, "simulator", None) and field_name in type(n.config).model_fields
    ]
    if not touched:
        more = " (or engines or rate, with --fleet)" if not fleet else " (or engines, rate)"
        raise SimulateError(
            f"--sweep: no modelled node has a config field {field_name!r}{more}"
        )
    return [{"overrides": {field_name: v}} for v in values]


def sweep(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    field_name: str,
    values: Sequence[str],
    **kwargs: Any,
) -> list[Result]:
    runs = points(pipeline, field_name, values)
    return _side_by_side(
        lambda run: simulate(run.pop("pipeline", pipeline), trace, **run, **kwargs), runs
    )


def fleet_runs(
    pipeline: ResolvedPipeline,
    field_name: str,
    values: Sequence[str],
    routers: Sequence[str],
    trace: Sequence[TraceRequest] = (),
) -> list[dict[str, Any]]:
    """A fleet sweep's runs, value by value, each value once per router (a ``rate``'s
    speedup is ``trace``'s)."""
    return [
        {**point, "router": router}
        for point in points(pipeline, field_name, values, fleet=True, trace=trace)
        for router in routers
    ]


#: The function :func:`_side_by_side`'s forked workers run (set just before the fork:
#: a child reads the parent's trace and pipeline through it, without a copy in a pipe).
_SHARED: dict[str, Callable[[dict[str, Any]], Any]] = {}


def _side_by_side(run_one: Callable[[dict[str, Any]], T], runs: list[dict[str, Any]]) -> list[T]:
    """``run_one`` of each run, in order, on the machine's cores where there are several
    (forked processes, one run each, no state shared; only a run's own arguments and
    its result cross a pipe)."""
    workers = min(len(runs), os.cpu_count() or 1)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [run_one(run) for run in runs]
    _SHARED["run"] = run_one
    try:
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            return list(pool.map(_shared_run, runs))
    finally:
        _SHARED.clear()


def _shared_run(run: dict[str, Any]) -> Any:
    return _SHARED["run"](run)


def simulate_many(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    runs: Sequence[dict[str, Any]],
    **common: Any,
) -> list[FleetResult]:
    """:func:`simulate_fleet` once per item of ``runs`` (its arguments over ``common``; a
    ``pipeline`` item replaces the pipeline), in order, side by side on the machine's
    cores."""
    # The trace's keys, made once: every run of one unit size replays the same keys
    # (each run's engines are its own; a key names a prefix, not where it is held).
    made: dict[tuple[int, int], list[Units]] = {}
    keyed = [{**run, "units": _units_for(pipeline, trace, {**common, **run}, made)}
             for run in runs]
    return _side_by_side(lambda run: _one(pipeline, trace, made, {**common, **run}), keyed)


def _one(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    made: dict[tuple[int, int], list[Units]],
    kwargs: dict[str, Any],
) -> FleetResult:
    key = kwargs.pop("units")
    kwargs["units"] = made[key] if key is not None else None
    return simulate_fleet(kwargs.pop("pipeline", pipeline), trace, **kwargs)


def _units_for(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    kwargs: dict[str, Any],
    made: dict[tuple[int, int], list[Units]],
) -> tuple[int, int] | None:
    """The key in ``made`` of the trace's units for a run's block sizes (made once for the
    runs of the same ones), or None where its options are bad (its own run says why)."""
    bytes_per_block = kwargs.get("bytes_per_block", 0)
    groups = tuple(kwargs.get("groups") or (SimKVGroup("attention", bytes_per_block),))
    block_size = kwargs.get("block_size", 32)
    tbt = kwargs.get("trace_block_tokens", MOONCAKE_BLOCK_TOKENS)
    try:
        _check_options(bytes_per_block, block_size, tbt, 0)
    except SimulateError:
        return None
    run_pipeline = kwargs.get("pipeline", pipeline)
    unit = unit_for(
        run_pipeline, kwargs.get("overrides") or {}, groups, block_size, tbt,
        kwargs.get("exact", False), [],
    )
    if (unit * block_size, tbt) not in made:
        keymaker = KeyMaker(block_size * unit, tbt)
        # (A replay of the run's sizes: its tiers' slots are allocated, not used.)
        probe = Replay(run_pipeline, {}, keymaker, unit, bytes_per_block, 0, groups)
        made[unit * block_size, tbt] = [probe.units(r) for r in trace]
    return unit * block_size, tbt
