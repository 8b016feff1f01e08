"""Which of a model's KV cache groups each node of a pipeline serves, before launch.

:func:`check_model` takes a validated pipeline and a :class:`~composer.model.kv_groups.ModelKV`
(predicted from ``config.json`` by :func:`composer.model.kv_groups.predict`), works out
the groups vLLM will actually run (its hybrid KV cache manager is off unless
every node supports it) and asks each node's plugin type what it serves
(``PluginType.model_support``, or the rules of :mod:`composer.model.support`).
A refusal is a located :class:`Problem`.
:func:`check_at_engine_start` asks the same of the groups a running engine has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from composer.errors import Path, Problem
from composer.loader import Marks
from composer.model.kv_groups import ModelKV, ModelUnsupported, from_kv_cache_config
from composer.model.support import node_support
from composer.pipeline import ResolvedPipeline

#: vLLM turns its hybrid manager off for chunked local attention unless this is set
#: (``VllmConfig.__post_init__``: a latency regression otherwise).
CHUNKED_HMA_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"


@dataclass(frozen=True)
class ModelCheck:
    """What a pipeline does with a model."""

    #: The groups as predicted (hybrid manager on).
    model: ModelKV
    #: The groups vLLM runs for this pipeline (one group when the hybrid manager is off).
    runs: ModelKV
    #: Why the hybrid manager is off; empty when it is on.
    hma_off: str = ""
    #: Node id -> the line saying what it serves (nodes that refused are in ``problems``).
    serves: dict[str, str] = field(default_factory=dict)
    #: Warnings: the pipeline runs, but not the way a reader may expect.
    notes: tuple[str, ...] = ()
    problems: tuple[Problem, ...] = ()


def _hma_off_reason(pipeline: ResolvedPipeline, model: ModelKV) -> tuple[str, list[Path]]:
    """Why vLLM runs this model with its hybrid manager off, and where to point at."""
    if pipeline.source.get("hma") == "off":
        return "the pipeline sets hma: off", [("hma",)]
    if not pipeline.hma:
        lacking = [n.id for n in pipeline.nodes if not n.allows_hma]
        names = ", ".join(f'"{n}"' for n in lacking)
        node_word = "node" if len(lacking) == 1 else "nodes"
        return (
            f"{node_word} {names} {'does' if len(lacking) == 1 else 'do'} not support it",
            [("nodes", n) for n in lacking],
        )
    if "chunked_local" in model.kinds and not os.environ.get(CHUNKED_HMA_ENV):
        return f"vLLM turns it off for chunked local attention (unless {CHUNKED_HMA_ENV}=1)", []
    return "", []


def check_model(
    pipeline: ResolvedPipeline, model: ModelKV, *, marks: Marks | None = None
) -> ModelCheck:
    """Each node's line for ``model`` in this pipeline, and the refusals as problems."""
    marks = marks or Marks()

    def problem(path: Path, message: str) -> Problem:
        line, column = marks.locate(path)
        return Problem(path, message, pipeline.file, line, column)

    runs, notes = model, []
    reason, where = _hma_off_reason(pipeline, model) if len(model.groups) > 1 else ("", [])
    if reason:
        try:
            runs = model.without_hma()
        except ModelUnsupported as exc:
            fix = (
                "remove hma: off"
                if where == [("hma",)]
                else "serve it with nodes that support the hybrid manager"
            )
            message = f"{exc}; the hybrid manager is off because {reason}: {fix}"
            return ModelCheck(
                model, model, reason,
                problems=tuple(problem(p, message) for p in where or [()]),
            )
        notes.append(
            f"vLLM's hybrid KV cache manager is off ({reason}): it runs one KV cache group, "
            "and sliding-window / chunked layers keep the whole context"
        )
    serves: dict[str, str] = {}
    problems: list[Problem] = []
    for node in pipeline.nodes:
        try:
            serves[node.id] = node_support(node, runs)
        except ModelUnsupported as exc:
            problems.append(problem(("nodes", node.id), str(exc)))
    return ModelCheck(model, runs, reason, serves, tuple(notes), tuple(problems))


def check_at_engine_start(
    pipeline: ResolvedPipeline, kv_cache_config: object, *, model_name: str = ""
) -> None:
    """Refuse, with the same messages as ``kvc validate --model``, the KV cache groups of
    a starting engine that a node cannot serve (``ValueError``).

    ``kv_cache_config`` is vLLM's ``KVCacheConfig``: these are the groups vLLM
    really formed, so the hybrid manager's state is already applied to them.
    """
    model = from_kv_cache_config(kv_cache_config, name=model_name)
    refusals = []
    for node in pipeline.nodes:
        try:
            node_support(node, model)
        except ModelUnsupported as exc:
            refusals.append(f"{pipeline.file}: nodes.{node.id}: {exc}")
    if refusals:
        raise ValueError("\n".join(refusals))
