"""``CPUOffloadNode``: the ``offload-cpu`` pipeline node (both vLLM roles).

vLLM runs the scheduler-side and the worker-side connector in different
processes; each gets its own instance of this class. The scheduler instance
delegates to :class:`~kvc_offload_cpu.scheduler.SchedulerHalf` (the index), the
worker instance to :class:`~kvc_offload_cpu.worker.WorkerHalf` (the bytes).
"""

from __future__ import annotations

from typing import Any

from composer.hookspecs import hookimpl
from composer.kv_caches import CanonicalKVCaches
from composer.plugin import NodeContext, Plugin
from composer.views import RequestView, StepView
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.layout import BlockLayout, layout_from_kv_cache_config
from kvc_offload_cpu.metadata import OffloadMetadata, OffloadWorkerMeta
from kvc_offload_cpu.scheduler import SchedulerHalf


class CPUOffloadNode(Plugin):
    """A CPU memory tier: whole KV blocks in a preallocated host pool, LRU, prefix hits."""

    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        config = ctx.config
        if not isinstance(config, OffloadCPUConfig):
            config = OffloadCPUConfig.model_validate(
                config.model_dump() if hasattr(config, "model_dump") else config
            )
        self.config = config
        layout: BlockLayout | None = None
        if ctx.kv_cache_config is not None:
            layout = layout_from_kv_cache_config(ctx.kv_cache_config)
        self.scheduler: SchedulerHalf | None = None
        self.worker: Any = None
        if ctx.vllm_role == "scheduler":
            if layout is None:
                raise ValueError("offload-cpu: the scheduler half needs vLLM's KVCacheConfig")
            self.scheduler = SchedulerHalf(
                config,
                layout,
                stats=self.stats,
                log=self.log,
                node_role=ctx.role,
                num_workers=_num_workers(ctx.vllm_config),
                hash_block_size=getattr(ctx.kv_cache_config, "hash_block_size", None),
            )
        else:
            from kvc_offload_cpu.worker import WorkerHalf  # torch only in the worker

            self.worker = WorkerHalf(config, layout, stats=self.stats, log=self.log)

    # -- worker, once -------------------------------------------------------- #

    @hookimpl
    def register_kv_caches(self, kv_caches: CanonicalKVCaches, raw: dict[str, Any]) -> None:
        if self.worker is not None:
            self.worker.register_kv_caches(kv_caches)

    # -- scheduler ----------------------------------------------------------- #

    @hookimpl
    def on_new_request(self, request: RequestView) -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @hookimpl
    def update_state_after_alloc(
        self, request: RequestView, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    @hookimpl
    def build_connector_meta(self, step: StepView) -> OffloadMetadata:
        if self.scheduler is None:
            return OffloadMetadata()
        return self.scheduler.build_connector_meta(step)

    @hookimpl
    def update_connector_output(self, worker_meta: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(worker_meta)

    @hookimpl
    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request, block_ids)

    @hookimpl
    def reset_cache(self) -> bool | None:
        if self.scheduler is not None:
            return self.scheduler.reset_cache()
        return True

    # -- worker, per step ---------------------------------------------------- #

    @hookimpl
    def handle_preemptions(self, metadata: Any) -> None:
        if self.worker is not None:
            self.worker.handle_preemptions(metadata)

    @hookimpl
    def bind_connector_metadata(self, metadata: Any) -> None:
        if self.worker is not None:
            self.worker.bind_connector_metadata(metadata)

    @hookimpl
    def start_load_kv(self, forward_context: Any) -> None:
        if self.worker is not None:
            self.worker.start_load_kv()

    @hookimpl
    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.wait_for_save()

    @hookimpl
    def clear_connector_metadata(self) -> None:
        if self.worker is not None:
            self.worker.clear_connector_metadata()

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        return self.worker.get_finished(finished_req_ids)

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None:
            return set()
        return self.worker.get_block_ids_with_load_errors()

    @hookimpl
    def build_connector_worker_meta(self) -> OffloadWorkerMeta | None:
        if self.worker is None:
            return None
        return self.worker.build_connector_worker_meta()

    @hookimpl
    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


def _num_workers(vllm_config: Any) -> int:
    """Workers whose confirmations a save needs (each holds its own shard of every block)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return 1
    return int(getattr(parallel, "world_size", 1) or 1)
