"""``kvc simulate --sweep``: one simulation per value of a config field of every
modelled node (:func:`composer.simulate.simulate` with ``overrides``), of the
pipeline's ``load_policy``, or, with ``--fleet``, of the number of ``engines``
(one fleet simulation per value and router)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, get_args

from composer.pipeline import LoadPolicy, ResolvedPipeline
from composer.simulate.replay import Result, simulate
from composer.simulate.tiers import SimulateError
from composer.trace import TraceRequest

#: The fleet's own sweepable field: how many engines.
ENGINES = "engines"


def parse_sweep(text: str) -> tuple[str, list[str]]:
    name, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name.strip() or not items:
        raise SimulateError(f"--sweep: expected FIELD=V1,V2,..., got {text!r}")
    return name.strip(), items


def points(
    pipeline: ResolvedPipeline, field_name: str, values: Sequence[str], *, fleet: bool = False
) -> list[dict[str, Any]]:
    """Each value's arguments to the simulation (a pipeline, overrides or engines), every
    value checked first."""
    if field_name == ENGINES and fleet:
        counts = []
        for v in values:
            try:
                counts.append(int(v))
            except ValueError:
                counts.append(0)
            if counts[-1] < 1:
                raise SimulateError(f"--sweep engines: {v!r}: expected a whole number >= 1")
        return [{"engines": n} for n in counts]
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
        more = " (or engines, with --fleet)" if not fleet else " (or engines)"
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
    return [
        simulate(run.pop("pipeline", pipeline), trace, **run, **kwargs) for run in runs
    ]


def fleet_runs(
    pipeline: ResolvedPipeline, field_name: str, values: Sequence[str], routers: Sequence[str]
) -> list[dict[str, Any]]:
    """A fleet sweep's runs, value by value, each value once per router."""
    return [
        {**point, "router": router}
        for point in points(pipeline, field_name, values, fleet=True)
        for router in routers
    ]
