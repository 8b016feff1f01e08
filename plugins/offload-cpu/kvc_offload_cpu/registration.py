"""Discovery: registers the ``offload-cpu`` plugin type. Light on purpose (no torch)."""

from __future__ import annotations

from collections.abc import Callable

from composer import Capabilities, PluginType, hookimpl
from kvc_offload_cpu.config import OffloadCPUConfig


def capabilities(config: OffloadCPUConfig) -> Capabilities:
    return Capabilities(
        # vLLM's hybrid manager stays on: blocks are indexed per KV cache group
        # (sliding windows keep only what a hit needs); state groups get no hits.
        hma=True,
        kv_cache_groups="all",
        async_save=config.save_mode == "async",
        async_load=config.load_mode == "async",
    )


OFFLOAD_CPU = PluginType(
    name="offload-cpu",
    # One class per vLLM process: the index in the scheduler, the bytes in each worker
    # (named as strings: the worker's module imports torch).
    scheduler="kvc_offload_cpu.scheduler:SchedulerHalf",
    worker="kvc_offload_cpu.worker:WorkerHalf",
    config=OffloadCPUConfig,
    description="CPU memory tier: whole KV blocks in a preallocated host pool, LRU, prefix hits.",
    roles={"load", "save", "both"},
    capabilities=capabilities,
    simulator="kvc_offload_cpu.simulate:OffloadCPUModel",
    model_support="kvc_offload_cpu.model_support:model_support",
)


@hookimpl
def register_plugin_types(register: Callable[[PluginType], None]) -> None:
    register(OFFLOAD_CPU)
