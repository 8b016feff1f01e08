"""``ModelTrackerNode``: the runtime half of the ``model-tracker`` plugin (workers only)."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from composer import NodeContext, Plugin, hookimpl
from kvc_model_tracker.config import ModelTrackerConfig
from kvc_model_tracker.handle import ModelHandle, ModelNotTracked, ModelSummary


def summarize(model: Any) -> ModelSummary:
    """Class, decoder layers, parameter count and dtype of a torch model (duck-typed)."""
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    dtype = str(params[0].dtype).removeprefix("torch.") if params else None
    return ModelSummary(
        model_class=type(model).__name__,
        layers=_num_layers(model),
        parameters=sum(int(p.numel()) for p in params),
        dtype=dtype,
    )


def _num_layers(model: Any) -> int | None:
    config = getattr(model, "config", None)
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    # vLLM's own models: ``model.model.layers`` (a ModuleList) for decoder-only LMs.
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return len(layers) if layers is not None and hasattr(layers, "__len__") else None


def lmcache_available() -> bool:
    """Is LMCache installed? Answered without importing it (``import lmcache`` loads torch)."""
    return importlib.util.find_spec("lmcache") is not None


class ModelTrackerNode(Plugin[ModelTrackerConfig]):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        self.handle = ModelHandle(ctx.node_id)

    def service(self) -> ModelHandle:
        return self.handle

    @hookimpl
    def initialize_worker_connector(
        self, model: Any, vllm_config: Any, kv_cache_config: Any
    ) -> None:
        if model is None:
            # Nothing to track: dependents get ModelNotTracked from require().
            self.log.warning("model-tracker: vLLM handed over no model")
            self.stats.gauges["model_tracked"] = 0
            self._report(vllm_config)
            return
        summary = summarize(model)
        self.handle.set(model, summary)
        self.stats.gauges["model_tracked"] = 1
        self.log.info("model tracked: " + summary.line())
        self._register_with_lmcache(model)
        self._report(vllm_config)

    def _register_with_lmcache(self, model: Any) -> None:
        mode = self.config.lmcache
        if mode == "never":
            return
        if not lmcache_available():
            if mode == "always":
                raise ModelNotTracked(
                    "model-tracker: lmcache: always, but LMCache is not installed "
                    "(pip install lmcache, or set lmcache: auto)"
                )
            self.log.debug("LMCache not installed; model not registered with it")
            return
        from lmcache.v1.compute.models.utils import VLLMModelTracker

        instance_id = self.config.lmcache_instance_id
        VLLMModelTracker.register_model(instance_id, model)
        # register_model keeps the first model registered under an id: check it is ours.
        if VLLMModelTracker.get_model(instance_id) is not model:
            raise ModelNotTracked(
                f"LMCache's VLLMModelTracker already holds another model under {instance_id!r}"
            )
        self.handle.lmcache_instance_id = instance_id
        self.log.info("model registered with LMCache's VLLMModelTracker", instance_id=instance_id)

    def _report(self, vllm_config: Any) -> None:
        if not self.config.report_file:
            return
        summary = self.handle.summary
        lmcache_model_matches = None
        if self.handle.lmcache_instance_id is not None:
            from lmcache.v1.compute.models.utils import VLLMModelTracker

            lmcache_model_matches = (
                VLLMModelTracker.get_model(self.handle.lmcache_instance_id) is self.handle.model
            )
        report = {
            "node": self.node_id,
            "pid": os.getpid(),
            "model_class": summary.model_class if summary else None,
            "layers": summary.layers if summary else None,
            "parameters": summary.parameters if summary else None,
            "dtype": summary.dtype if summary else None,
            "lmcache_instance_id": self.handle.lmcache_instance_id,
            "lmcache_model_matches": lmcache_model_matches,
        }
        rank = getattr(getattr(vllm_config, "parallel_config", None), "rank", 0) or 0
        path = f"{self.config.report_file}.{rank}"
        with open(path, "w") as f:
            json.dump(report, f)
