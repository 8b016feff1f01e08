"""``ComposedConnector``: a pipeline running inside vLLM as one KV connector.

vLLM creates it twice, once in the scheduler process (EngineCore) and once per
worker; each builds its process's half of the chain (:func:`~composer.chain.chain_for`)
and calls it. Every public method of vLLM's ``KVConnectorBase_V1`` is overridden
(a test checks this), so no node is ever silently skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import structlog
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CopyBlocksOp,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from composer.chain import (
    ChainMetadata,
    ChainWorkerMetadata,
    SchedulerChain,
    WorkerChain,
    chain_for,
)
from composer.vllm.canonical import build, refuse_moves
from composer.vllm.handoff import loaded_model
from composer.vllm.metrics import (
    ComposedPromMetrics,  # noqa: F401  (re-exported: known as the connector's)
    ComposedStats,  # noqa: F401  (re-exported: known as the connector's)
    _StatsType,
    build_prom_metrics,
    rebuild_stats,
)
from composer.vllm.native import NativeConnectorNode
from composer.vllm.pipeline_source import (
    hma_resolved_pipeline,
    native_classes,
    pipeline_checked_for_engine,
    required_kvcache_layout,
    requires_piecewise,
    sleep_mode_refusals,
    validated_pipeline,
)
from composer.vllm.surface import check_surface

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from composer.kv_caches import CanonicalKVCaches

log = structlog.get_logger("kv_composer")


#: What vLLM calls in a worker per layer and per step, bound in ``__init__`` to the
#: worker half's own methods: the method of the same name below does exactly that
#: (a test checks it), but the Python call it adds would show in ``make bench``'s
#: dispatch (composed vs MultiConnector) on the hottest paths.
# fmt: off
WORKER_HOT_PATH = (
    "wait_for_layer_load", "save_kv_layer", "handle_preemptions", "bind_connector_metadata",
    "start_load_kv", "wait_for_save", "clear_connector_metadata", "get_transfer_results",
    "get_block_ids_with_load_errors", "build_connector_worker_meta",
    "get_kv_connector_kv_cache_events",
)
# fmt: on


@dataclass
class ComposedMetadata(ChainMetadata, KVConnectorMetadata):
    pass


@dataclass
class ComposedWorkerMetadata(ChainWorkerMetadata, KVConnectorWorkerMetadata):  # type: ignore[misc]
    """ChainWorkerMetadata.aggregate merges per node and keeps this type."""


class ComposedConnector(KVConnectorBase_V1, SupportsHMA):
    """One vLLM KV connector running a KV Composer pipeline. As vLLM's own connectors
    hold a ``connector_scheduler`` or ``connector_worker``, it holds its process's half
    of the chain, typed: ``self.scheduler`` or ``self.worker`` (``self.chain``: either).
    Each method calls the half's method of its name, which calls the nodes (in a
    worker, vLLM calls the half's methods of :data:`WORKER_HOT_PATH` itself)."""

    scheduler: SchedulerChain  # (never set in a worker)
    worker: WorkerChain  # (never set in the scheduler)

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # A member a later vLLM added is named here; a gate refuses the engine.
        check_surface(ComposedConnector, KVConnectorBase_V1, log)
        self.pipeline = pipeline_checked_for_engine(vllm_config, kv_cache_config)
        process = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        stats_type = _StatsType()
        self.chain: SchedulerChain | WorkerChain = chain_for(
            self.pipeline,
            process,  # type: ignore[arg-type]
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            # The chain builds vLLM's result types itself: nothing to copy per step.
            metadata_type=ComposedMetadata,
            worker_metadata_type=ComposedWorkerMetadata,
            transfer_results_type=KVConnectorTransferResults,
            stats_type=stats_type,
            restore_worker_meta=True,
        )
        # Native nodes name their connector in their stats (rebuilt in the frontend).
        natives = self.chain.nodes.items()
        stats_type.natives = {
            i: node.identity for i, node in natives if isinstance(node, NativeConnectorNode)
        }
        if isinstance(self.chain, SchedulerChain):
            self.scheduler = self.chain
        if isinstance(self.chain, WorkerChain):  # (vLLM's own tests: a chain of both)
            self.worker = self.chain
            for name in WORKER_HOT_PATH:
                setattr(self, name, getattr(self.worker, name))
        self._model_delivered = False
        #: vLLM's KV caches as registered (sleep mode restores the views from them).
        self._kv_caches: dict[str, torch.Tensor] | None = None
        #: The canonical view of them the nodes got (None while vLLM sleeps).
        self.canonical_kv_caches: CanonicalKVCaches | None = None
        self._asleep = False
        log.info(
            "composed connector ready",
            process=process,
            nodes=list(self.chain.nodes),
            load_order=list(self.pipeline.load_order),
            save_to=list(self.pipeline.save_to),
            load_policy=self.pipeline.load_policy,
        )
        if process == "worker":
            self._deliver_model()

    # -- properties -------------------------------------------------------------- #

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def sub_connectors(self) -> list[KVConnectorBase_V1]:
        """The native nodes' connectors, in node order (as MultiConnector's)."""
        return [n.connector for n in self.chain.nodes.values() if hasattr(n, "connector")]

    @classmethod
    def all_nodes_support_hma(cls, kv_transfer_config: Any) -> bool:
        """Whether vLLM may keep its hybrid KV cache manager on for this pipeline.

        vLLM asks ``KVConnectorFactory.supports_hma_config``, which KV Composer's
        vLLM plugin routes here (MultiConnector has the same special case there).
        """
        return hma_resolved_pipeline(kv_transfer_config.kv_connector_extra_config).hma

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        native = self.sub_connectors
        return (
            bool(native)
            and len(native) == len(self.chain.nodes)
            and all(c.supports_divergent_local_hybrid_hits for c in native)
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.requires_kv_delivery for c in self.sub_connectors)

    # -- worker: initialize ------------------------------------------------------ #

    def initialize_worker_connector(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's own model hand-off, on versions that have it (not 0.32.0)."""
        model = kwargs.get("model") or (args[0] if args else None)
        if model is None and args and hasattr(args[0], "model"):
            model = args[0].model
        self._model_delivered = True
        self.worker.initialize_worker_connector(model, self._vllm_config, self._kv_cache_config)

    def _deliver_model(self) -> None:
        # vLLM 0.32.0 has no hook that hands connectors the model: our
        # vllm.general_plugins entry point records the model as the loader
        # builds it, in this same worker process, before the connector exists.
        if self._model_delivered or hasattr(KVConnectorBase_V1, "initialize_worker_connector"):
            return

        model = loaded_model()
        if model is None:
            log.warning("model hand-off: no model recorded in this worker process")
        self._model_delivered = True
        self.worker.initialize_worker_connector(model, self._vllm_config, self._kv_cache_config)

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        return cast("AbstractContextManager | None", self.worker.get_mem_pool_context())

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:

        canonical = build(kv_caches, self._kv_cache_config)
        self.canonical_kv_caches = canonical
        log.info(
            "KV caches registered",
            regions=len(canonical.regions),
            groups=len(canonical.groups),
            num_blocks=canonical.num_blocks,
            bytes_per_block=canonical.bytes_per_block,
        )
        self._kv_caches = kv_caches
        with refuse_moves(kv_caches):
            self.worker.register_kv_caches(canonical, kv_caches)

    # -- worker: sleep mode (vLLM 0.33 and later call these) --------------------- #

    def unregister_kv_caches(self) -> None:
        """Before vLLM sleeps or discards its KV cache. vLLM may call it again while
        asleep (a discard after a sleep): the nodes hear it once."""
        if self._kv_caches is None or self._asleep:
            return
        self._asleep = True
        self.canonical_kv_caches = None
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """After vLLM wakes up with its KV cache: the same tensors, remapped in place."""
        if self._kv_caches is None or not self._asleep:
            return

        self.canonical_kv_caches = build(self._kv_caches, self._kv_cache_config)
        self.worker.restore_kv_caches(self.canonical_kv_caches, self._kv_caches)
        self._asleep = False

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        self.worker.set_host_xfer_buffer_ops(copy_operation)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.get_handshake_metadata()

    # -- worker: per step -------------------------------------------------------- #

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.worker.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self.worker.handle_preemptions(cast(ComposedMetadata, kv_connector_metadata))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self.worker.bind_connector_metadata(cast(ComposedMetadata, connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def finish_forward(self) -> None:
        self.worker.finish_forward()

    def clear_connector_metadata(self) -> None:
        self.worker.clear_connector_metadata()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return cast(KVConnectorTransferResults, self.worker.get_transfer_results(finished_req_ids))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return cast("KVConnectorWorkerMetadata | None", self.worker.build_connector_worker_meta())

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.chain.get_kv_connector_stats()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.worker.get_kv_connector_kv_cache_events()

    def has_connector_metadata(self) -> bool:
        # vLLM asks this per layer; the chain holds the step's metadata.
        return self.worker.metadata is not None

    def reset_capture_state(self) -> None:
        self.worker.reset_capture_state()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def shutdown(self) -> None:
        self.chain.shutdown()

    # -- scheduler --------------------------------------------------------------- #

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)
        self.bind_gpu_block_pool(kv_cache_manager.block_pool)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.scheduler.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        groups = self.scheduler.get_loaded_kv_cache_group_ids(request)
        return groups if groups is not None else super().get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        sources = self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)
        if sources is not None:
            return sources
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return cast(KVConnectorMetadata, self.scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[Any]:
        return self.scheduler.take_events()

    def has_pending_block_frees(self) -> bool:
        return self.scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished_all_groups(request, block_ids)

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        return self.scheduler.register_finished_partial_tail(
            request, block_ids, partial_tail_offloads
        )

    def get_finished_count(self) -> int | None:
        return self.scheduler.get_finished_count()

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        self.scheduler.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool | None:
        return self.chain.reset_cache()

    # -- classmethods: asked before any instance exists -------------------------- #

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        assert vllm_config.kv_transfer_config is not None
        return required_kvcache_layout(
            validated_pipeline(vllm_config.kv_transfer_config.kv_connector_extra_config),
            vllm_config,
        )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """MultiConnector's rule: every node must (a ``vllm`` node's connector class
        answers for it); each node that cannot is named, with why."""
        pipeline = validated_pipeline(kv_transfer_config.kv_connector_extra_config)
        refusals = sleep_mode_refusals(pipeline)
        for node, why in refusals:
            log.error("this pipeline cannot sleep", node=node.id, why=why)
        return not refusals

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return requires_piecewise(validated_pipeline(extra_config))

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return rebuild_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        assert vllm_config.kv_transfer_config is not None
        pipeline = validated_pipeline(vllm_config.kv_transfer_config.kv_connector_extra_config)
        return build_prom_metrics(
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
            pipeline,
            native_classes(pipeline, vllm_config),
        )
