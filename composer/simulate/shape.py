"""A model's KV cache groups and the bytes of a tier slot, from its ``config.json``.

The file is read by :func:`composer.model.kv_groups.predict` (the one config.json
reader, also behind ``kvc validate --model``); this module turns its groups
into :class:`~composer.simulate.SimKVGroup` for ``kvc simulate`` and its errors
into :class:`~composer.simulate.SimulateError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from composer.model.kv_groups import ModelConfigError, ModelKV, predict
from composer.pipeline import ResolvedPipeline
from composer.simulate.tiers import SimKVGroup, SimulateError
from composer.validation.model_check import check_model


@dataclass(frozen=True)
class ModelShape:
    """What ``kvc simulate`` needs of a model."""

    #: Tokens per block vLLM runs (a mamba hybrid's attention block may be larger).
    block_size: int
    #: Bytes of a tier slot: every layer's block with one group, the largest group's with several.
    bytes_per_block: int
    groups: tuple[SimKVGroup, ...]
    notes: tuple[str, ...] = ()


def model_shape(
    path: str | Path, block_size: int, pipeline: ResolvedPipeline | None = None
) -> ModelShape:
    """The groups vLLM runs for the model at ``path`` (a config.json or a model directory),
    with ``pipeline``'s hybrid manager setting when given."""
    try:
        model = predict(path, block_size=block_size)
    except ModelConfigError as exc:
        raise SimulateError(f"{path}: cannot read model config: {exc}") from None
    if not model.groups:
        raise SimulateError(f"{path}: the model has no layer with a KV cache")
    notes = list(model.notes)
    if pipeline is not None:
        model = _as_run(pipeline, model, notes)
    groups = tuple(
        SimKVGroup(g.kind, g.bytes_per_token * (g.block_size or 0), g.window or 0)
        for g in model.groups
    )
    sizes = {g.block_size for g in model.groups if g.block_size}
    runs = sizes.pop() if len(sizes) == 1 else block_size
    if runs != block_size:
        notes.append(
            f"block size {runs} tokens: vLLM grows the attention block of {model.label} until "
            "one block holds a layer's mamba state"
        )
    slot = max(g.page_bytes * g.layers for g in model.groups)
    return ModelShape(runs, slot, groups, tuple(notes))


def _as_run(pipeline: ResolvedPipeline, model: ModelKV, notes: list[str]) -> ModelKV:
    """The groups vLLM runs for ``pipeline`` (one, when its hybrid manager is off)."""
    check = check_model(pipeline, model)
    if check.problems:
        raise SimulateError(str(check.problems[0]))
    notes.extend(check.notes)
    return check.runs


def bytes_per_block_from_config(path: str | Path, block_size: int) -> int:
    """Bytes of a tier slot for the model at ``path``: for a model of one KV cache group,
    layers x 2 (K and V) x kv_heads x head_dim x dtype bytes x block tokens."""
    return model_shape(path, block_size).bytes_per_block
