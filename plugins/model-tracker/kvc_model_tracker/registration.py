"""Discovery: registers the ``model-tracker`` plugin type. Light on purpose (no torch)."""

from __future__ import annotations

from collections.abc import Callable

from composer import Capabilities, PluginType, hookimpl, no_kv_blocks
from kvc_model_tracker.config import ModelTrackerConfig

MODEL_TRACKER = PluginType(
    name="model-tracker",
    # The model exists only in worker processes; the scheduler (EngineCore) has none.
    worker="kvc_model_tracker.node:ModelTrackerNode",
    config=ModelTrackerConfig,
    description="Receives vLLM's loaded model and offers it to nodes that need it (and LMCache).",
    roles={"service"},
    # It never touches KV blocks, so it is no obstacle to the hybrid allocator.
    capabilities=Capabilities(provides_model=True, hma=True),
    model_support=no_kv_blocks,
)


@hookimpl
def register_plugin_types(register: Callable[[PluginType], None]) -> None:
    register(MODEL_TRACKER)
