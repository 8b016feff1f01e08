"""``LMCacheInProcessNode``: LMCache's own vLLM connector implementation inside vLLM (GPU).

vLLM's ``LMCacheConnectorV1`` is a thin parent around LMCache's
``LMCacheConnectorV1Impl``; the impl reads its config from the parent's
``kv_connector_extra_config`` (``lmcache.<field>`` keys), its metadata from
the parent (``_get_connector_metadata``), and checks that the parent
implements ``register_kv_caches``. This node gives it such a parent and
forwards the hooks.

Hybrid models (HMA, vLLM PR 42620): LMCache's impl handles one block table.
With ``kv_cache_group: g`` the node checks that group ``g`` exists and is full
attention, registers only that group's layers, hands the impl scheduler
output whose block ids are group ``g``'s, and the chain (Capabilities
``kv_cache_groups="one"``) passes ``request_finished_all_groups`` only that
group's block ids.

Unverified on a GPU: LMCache's in-process engine needs CUDA/XPU; on CPU it is
unit-tested against LMCache's real classes with the engine pieces replaced.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from composer import NodeContext, Plugin, hookimpl
from kvc_lmcache import memory
from kvc_lmcache.config import LMCacheConfig
from kvc_lmcache.sizes import GIB, shown

#: The instance id LMCache's vLLM integration (and CacheBlend) looks the model up under.
LMCACHE_ENGINE_NAME = "vllm-instance"


class InvalidKVCacheGroup(ValueError):
    pass


def select_group(kv_cache_config: Any, group: int) -> list[str]:
    """The layer names of KV cache group ``group``; a clear error unless it is full attention."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    listing = ", ".join(f"{i}: {k}" for i, k in enumerate(kinds)) or "none"
    if group >= len(groups):
        raise InvalidKVCacheGroup(
            f"lmcache: kv_cache_group {group} does not exist; this model's KV cache groups "
            f"are {listing}"
        )
    spec = groups[group].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec):
        full = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        raise InvalidKVCacheGroup(
            f"lmcache: kv_cache_group {group} is {kinds[group]}, not full attention; LMCache "
            f"handles a full-attention group: {full or 'this model has none'} (groups: {listing})"
        )
    return list(groups[group].layer_names)


def child_vllm_config(config: LMCacheConfig, vllm_config: Any) -> Any:
    """A shallow copy of ``vllm_config`` whose kv_transfer_config carries ``lmcache.*`` keys."""
    parent = vllm_config.kv_transfer_config
    extra = {f"lmcache.{k}": v for k, v in config.engine_config().items()}
    temp = copy.copy(vllm_config)
    temp.kv_transfer_config = KVTransferConfig(
        kv_connector="LMCacheConnectorV1",
        kv_role=parent.kv_role,
        engine_id=parent.engine_id,
        kv_connector_extra_config=extra,
    )
    return temp


def _nothing() -> None:
    return None


class LMCacheParent(KVConnectorBase_V1):
    """What the impl expects of its parent connector: metadata and ``register_kv_caches``."""

    impl: Any = None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.impl.register_kv_caches(kv_caches)

    # The node calls the impl itself; these exist because the base class is abstract.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.impl.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.impl.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        self.impl.save_kv_layer(layer_name, kv_layer, attn_metadata, **kw)

    def wait_for_save(self) -> None:
        self.impl.wait_for_save()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return self.impl.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.impl.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self.impl.build_connector_meta(scheduler_output)


def impl_class() -> type:
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    cls: type = LMCacheConnectorV1Impl
    return cls


def group_view(scheduler_output: Any, group: int) -> Any:
    """``scheduler_output`` with every request's block ids narrowed to ``(ids[group],)``.

    LMCache's impl reads group 0 of each request's block ids; this hands it the
    selected group's instead, without touching vLLM's own objects.
    """
    if group == 0:
        return scheduler_output
    view = copy.copy(scheduler_output)
    new_reqs = []
    for req in scheduler_output.scheduled_new_reqs:
        r = copy.copy(req)
        if isinstance(req.block_ids, tuple):
            r.block_ids = (req.block_ids[group],)
        new_reqs.append(r)
    view.scheduled_new_reqs = new_reqs
    cached = copy.copy(scheduler_output.scheduled_cached_reqs)
    cached.new_block_ids = [
        (ids[group],) if isinstance(ids, tuple) else ids for ids in cached.new_block_ids
    ]
    view.scheduled_cached_reqs = cached
    return view


def check_cpu_buffer_fits(node_id: str, config: LMCacheConfig) -> None:
    """Raise ``ValueError`` when the CPU buffer LMCache's engine allocates in this worker
    process (``max_local_cpu_size``, whether or not ``local_cpu`` keeps chunks there;
    LMCache 0.5.6's ``_Create_memory_allocator``) is more than the memory available now.
    With ``gds_path`` it allocates a GDS buffer instead."""
    if config.extra.get("gds_path") is not None:
        return
    size = int(config.max_local_cpu_size * GIB)
    memory.check_fits(
        f'lmcache node "{node_id}": max_local_cpu_size {shown(config.max_local_cpu_size)} '
        f"({memory.human(size)} of CPU buffer in this vLLM worker process)",
        size,
        "lower max_local_cpu_size (each vLLM worker process allocates one)",
    )


class LMCacheInProcessNode(Plugin):
    def __init__(self, ctx: NodeContext) -> None:
        super().__init__(ctx)
        config = ctx.config
        assert isinstance(config, LMCacheConfig)
        self.config: LMCacheConfig = config
        self.group = config.kv_cache_group
        self.group_layers: list[str] | None = None
        if self.group is not None:
            self.group_layers = select_group(ctx.kv_cache_config, self.group)
        if ctx.process == "worker":
            check_cpu_buffer_fits(ctx.node_id, config)
        role = KVConnectorRole.SCHEDULER if ctx.process == "scheduler" else KVConnectorRole.WORKER
        temp = child_vllm_config(config, ctx.vllm_config)
        self.parent = LMCacheParent(temp, role, ctx.kv_cache_config)
        self.impl = impl_class()(temp, role, self.parent)
        self.parent.impl = self.impl

    @hookimpl
    def initialize_worker_connector(
        self, model: Any, vllm_config: Any, kv_cache_config: Any
    ) -> None:
        if not self.config.enable_blending:
            return
        handles = [s for s in self.ctx.needs.values() if hasattr(s, "require")]
        if not handles:
            raise RuntimeError("lmcache: enable_blending needs a model-tracker node in `needs`")
        handles[0].require()
        instance_id = getattr(handles[0], "lmcache_instance_id", None)
        if instance_id != LMCACHE_ENGINE_NAME:
            raise RuntimeError(
                f"lmcache: CacheBlend looks the model up under {LMCACHE_ENGINE_NAME!r} in LMCache's"
                " "
                f"VLLMModelTracker, but the tracker registered it under {instance_id!r} "
                "(set the tracker's lmcache_instance_id, and lmcache: auto/always)"
            )

    # -- worker ------------------------------------------------------------- #

    @hookimpl
    def register_kv_caches(self, raw: dict[str, Any]) -> None:
        if self.group_layers is not None:
            raw = {name: t for name, t in raw.items() if name in self.group_layers}
        self.parent.register_kv_caches(raw)

    # Sleep mode: as vLLM's own LMCacheConnectorV1 (0.33), which leaves both to
    # LMCache's adapter: vLLM's do-nothing default where the adapter has none.

    @hookimpl
    def unregister_kv_caches(self) -> None:
        getattr(self.impl, "unregister_kv_caches", _nothing)()

    @hookimpl
    def restore_kv_caches(self) -> None:
        getattr(self.impl, "restore_kv_caches", _nothing)()

    @hookimpl
    def bind_connector_metadata(self, metadata: Any) -> None:
        self.parent.bind_connector_metadata(metadata)
        if hasattr(self.impl, "bind_connector_metadata"):
            self.impl.bind_connector_metadata(metadata)

    @hookimpl
    def clear_connector_metadata(self) -> None:
        self.parent.clear_connector_metadata()

    @hookimpl
    def start_load_kv(self, forward_context: Any) -> None:
        self.impl.start_load_kv(forward_context)

    @hookimpl
    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.group_layers is None or layer_name in self.group_layers:
            self.impl.wait_for_layer_load(layer_name)

    @hookimpl
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        if self.group_layers is None or layer_name in self.group_layers:
            self.impl.save_kv_layer(layer_name, kv_layer, attn_metadata)

    @hookimpl
    def wait_for_save(self) -> None:
        self.impl.wait_for_save()

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> Any:
        return self.impl.get_finished(finished_req_ids)

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.impl.get_block_ids_with_load_errors())

    # -- scheduler ------------------------------------------------------------ #

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        tokens, load_async = self.impl.get_num_new_matched_tokens(request.raw, num_computed_tokens)
        if tokens:
            self.stats.extra.add("lookup_hit_tokens", tokens)
        return tokens, load_async

    @hookimpl
    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        self.impl.update_state_after_alloc(request.raw, num_external_tokens)

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        view = group_view(scheduler_output, self.group or 0)
        return self.impl.build_connector_meta(view)

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        return self.impl.request_finished(request.raw, block_ids)

    @hookimpl
    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        # The chain passes only this node's group (Capabilities kv_cache_groups="one").
        if len(block_ids) != 1:
            raise InvalidKVCacheGroup(
                "lmcache: expected the block ids of one KV cache group, "
                f"got {len(block_ids)} groups"
            )
        return self.impl.request_finished(request.raw, block_ids[0])

    @hookimpl
    def shutdown(self) -> None:
        self.impl.shutdown()
