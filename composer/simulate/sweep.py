"""``kvc simulate --sweep``: one simulation per value of a config field of every
modelled node (:func:`composer.simulate.simulate` with ``overrides``), or of the
pipeline's ``load_policy``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, get_args

from composer.pipeline import LoadPolicy, ResolvedPipeline
from composer.simulate.replay import Result, simulate
from composer.simulate.tiers import SimulateError
from composer.trace import TraceRequest


def parse_sweep(text: str) -> tuple[str, list[str]]:
    name, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name.strip() or not items:
        raise SimulateError(f"--sweep: expected FIELD=V1,V2,..., got {text!r}")
    return name.strip(), items


def sweep(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    field_name: str,
    values: Sequence[str],
    **kwargs: Any,
) -> list[Result]:
    if field_name == "load_policy":
        allowed = get_args(LoadPolicy)
        bad = [v for v in values if v not in allowed]
        if bad:
            raise SimulateError(
                f"--sweep load_policy: {', '.join(map(repr, bad))}: expected one of "
                + ", ".join(map(repr, allowed))
            )
        return [
            simulate(dataclasses.replace(pipeline, load_policy=v), trace, **kwargs)  # type: ignore[arg-type]
            for v in values
        ]
    touched = [
        n.id for n in pipeline.nodes
        if getattr(n.plugin, "simulator", None) and field_name in type(n.config).model_fields
    ]
    if not touched:
        raise SimulateError(f"--sweep: no modelled node has a config field {field_name!r}")
    return [
        simulate(pipeline, trace, overrides={field_name: v}, **kwargs) for v in values
    ]
