"""Model hand-off for vLLM versions without ``initialize_worker_connector``.

:func:`install` (run by our ``vllm.general_plugins`` entry point in every vLLM
process) wraps vLLM's model loader so that the first model it builds in a
process is remembered; the worker-side ComposedConnector, created after the
model is loaded, hands it to every node through ``initialize_worker_connector``.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

_model: weakref.ReferenceType[Any] | None = None
_installed = False


def record(model: Any) -> None:
    global _model
    if _model is None or _model() is None:
        _model = weakref.ref(model)


def loaded_model() -> Any:
    return _model() if _model is not None else None


def install() -> None:
    global _installed
    if _installed:
        return
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(self, *args, **kwargs)
        record(model)
        return model

    BaseModelLoader.load_model = load_model  # type: ignore[method-assign]
    _installed = True
