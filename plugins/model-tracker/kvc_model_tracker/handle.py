"""``ModelHandle``: what nodes that ``need`` a model-tracker node receive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ModelNotTracked(RuntimeError):
    """A node asked for the model before (or without) vLLM handing it over."""


@dataclass
class ModelSummary:
    model_class: str
    layers: int | None
    parameters: int
    dtype: str | None

    def line(self) -> str:
        layers = "?" if self.layers is None else str(self.layers)
        return (
            f"{self.model_class}: {layers} layers, {self.parameters:,} parameters, "
            f"dtype {self.dtype or '?'}"
        )


class ModelHandle:
    """The model tracked by one model-tracker node, in one worker process.

    It is filled when vLLM hands the model over (``initialize_worker_connector``),
    which the chain does for the tracker before any node that needs it, so a
    dependent node can call :meth:`require` from its own
    ``initialize_worker_connector`` or later.
    """

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._model: Any = None
        self.summary: ModelSummary | None = None
        #: The LMCache instance id the model was registered under, if it was.
        self.lmcache_instance_id: str | None = None

    @property
    def model(self) -> Any:
        """The model, or None when none was handed over (yet)."""
        return self._model

    def require(self) -> Any:
        """The model; a clear error when there is none."""
        if self._model is None:
            raise ModelNotTracked(
                f'model-tracker node "{self.node_id}" has no model: vLLM has not handed it '
                "over in this process (it is only available in worker processes, from "
                "initialize_worker_connector on)"
            )
        return self._model

    def set(self, model: Any, summary: ModelSummary) -> None:
        self._model = model
        self.summary = summary

    def __repr__(self) -> str:
        what = self.summary.line() if self.summary else "no model"
        return f"<ModelHandle node={self.node_id!r} {what}>"
