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

What LMCache returns, as LMCache 0.5.6 returns it: its impl's
``get_num_new_matched_tokens`` answers an ``int`` (the tokens to load; 0 when its
engine did not start and it runs *degraded*) or ``None`` while an asynchronous
lookup is pending; vLLM's own ``LMCacheConnectorV1`` adds the ``False`` (loads
are synchronous). The node does the same, asks again on the next step for a
pending lookup (as vLLM's scheduler does) and refuses anything else by name.

Degraded LMCache (its engine or lookup client failed to start: LMCache logs the
traceback and recomputes everything) is said at engine start with LMCache's
reason: under ``on_error: fail`` the node refuses to start; otherwise it
serves nothing and the engine keeps serving.

Tenants: LMCache's in-process connector keys KV by token ids and ignores vLLM's
``cache_salt`` (LMCache #2878). Its keys do carry *tags* (``lmcache.tag.<name>``
request configs, part of every ``CacheEngineKey``, its ``to_string`` and so of
an L2 store's keys), so the node hands LMCache each salted request with the tag
``kvc_salt`` = a hash of its salt, and an unsalted one without it
(:mod:`kvc_lmcache.tenants`): a request is served only KV computed under its
own salt.

Unverified on a GPU: LMCache's in-process engine needs CUDA/XPU; on CPU it is
unit-tested against LMCache's real classes (the impl, its manager, config and
request-config functions) with only the CUDA parts stood in.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from composer import NodeContext, Plugin, hookimpl
from kvc_lmcache import memory
from kvc_lmcache.config import LMCacheConfig
from kvc_lmcache.lmcache_internals import init_failure, launch_problems, refuse_unknown_lmcache
from kvc_lmcache.sizes import GIB, shown
from kvc_lmcache.tenants import SaltedRequest, salted

#: The instance id LMCache's vLLM integration (and CacheBlend) looks the model up under.
LMCACHE_ENGINE_NAME = "vllm-instance"


class InvalidKVCacheGroup(ValueError):
    pass


class LMCacheDegraded(RuntimeError):
    """LMCache's engine (or lookup client) did not start: it recomputes everything."""


class LMCacheContractError(TypeError):
    """LMCache answered what no LMCache release the node knows answers."""


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


def lmcache_view(scheduler_output: Any, group: int, salts: dict[str, str]) -> Any:
    """``scheduler_output`` as LMCache's impl should read it, vLLM's own objects untouched.

    Each new request's sampling params :func:`salted` by its salt (``salts``:
    request id -> salt, from the lookup; LMCache's impl keeps the request configs
    it reads here for the request's saves); one the node never saw is saved by
    no one (``lmcache.skip_save``), since its salt is unknown. And every request's
    block ids narrowed to ``(ids[group],)``: LMCache's impl reads group 0.
    """
    if not group and not scheduler_output.scheduled_new_reqs:
        return scheduler_output  # (most steps: nothing to show otherwise)
    view = copy.copy(scheduler_output)
    new_reqs = []
    for req in scheduler_output.scheduled_new_reqs:
        r = copy.copy(req)
        salt = salts.get(req.req_id)
        r.sampling_params = salted(req.sampling_params, salt or "", skip_save=salt is None)
        if group and isinstance(req.block_ids, tuple):
            r.block_ids = (req.block_ids[group],)
        new_reqs.append(r)
    view.scheduled_new_reqs = new_reqs
    if not group:
        return view
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
    node = f'lmcache node "{node_id}": ' if node_id else ""
    memory.check_fits(
        f"{node}max_local_cpu_size {shown(config.max_local_cpu_size)} "
        f"({memory.human(size)} of CPU buffer in this vLLM worker process)",
        size,
        "lower max_local_cpu_size (each vLLM worker process allocates one)",
    )


class LMCacheInProcessNode(Plugin):
    @classmethod
    def launch_problems(cls, config: Any) -> list[str]:
        problems = launch_problems("in_process")
        try:  # (LMCache would allocate it at the worker's start, then degrade or crash)
            check_cpu_buffer_fits("", config)
        except ValueError as exc:
            problems.append(str(exc))
        return problems

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
        refuse_unknown_lmcache(ctx.node_id, "in_process")
        role = KVConnectorRole.SCHEDULER if ctx.process == "scheduler" else KVConnectorRole.WORKER
        temp = child_vllm_config(config, ctx.vllm_config)
        self.parent = LMCacheParent(temp, role, ctx.kv_cache_config)
        self.impl = impl_class()(temp, role, self.parent)
        self.parent.impl = self.impl
        #: Why LMCache runs degraded ("": it does not): the node then serves nothing.
        self.degraded = ""
        #: Request id -> its cache_salt ("" for none), from its lookup to its end.
        self.salts: dict[str, str] = {}
        self._check_started("start")

    def _check_started(self, when: str) -> None:
        """Say once that LMCache runs degraded, with its reason; refuse under ``fail``."""
        reason = init_failure(self.impl)
        if not reason or self.degraded:
            return
        message = (
            f'lmcache node "{self.node_id}": LMCache runs degraded (it recomputes everything) '
            f"since its {when}: {reason}"
        )
        if self.ctx.on_error == "fail":
            raise LMCacheDegraded(
                message + "; on_error is fail, so the engine does not start (on_error: "
                "recompute or disable keeps serving without this node)"
            )
        self.degraded = reason
        self.stats.gauges["lmcache_degraded"] = 1
        self.log.warning(message + "; the node serves and saves nothing", reason=reason)

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
        # LMCache builds its engine here (post_init): it may degrade now.
        self._check_started("KV caches were registered")

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
        self.salts[request.request_id] = request.tenant
        if self.degraded:
            return 0, False
        tokens = self.impl.get_num_new_matched_tokens(
            SaltedRequest(request.raw), num_computed_tokens
        )
        if tokens is None:
            return None, False  # LMCache's lookup is pending: vLLM asks again next step
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise LMCacheContractError(
                "LMCache's LMCacheConnectorV1Impl.get_num_new_matched_tokens returned "
                f"{tokens!r}; LMCache 0.5.6 returns the tokens to load (an int >= 0) or None "
                "(a lookup pending)"
            )
        if tokens:
            self.stats.extra.add("lookup_hit_tokens", tokens)
        # Loads are synchronous, as vLLM's own LMCacheConnectorV1 says.
        return tokens, False

    @hookimpl
    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        self.salts[request.request_id] = request.tenant
        self.impl.update_state_after_alloc(SaltedRequest(request.raw), num_external_tokens)

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        view = lmcache_view(scheduler_output, self.group or 0, self.salts)
        return self.impl.build_connector_meta(view)

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        self.salts.pop(request.request_id, None)
        return self.impl.request_finished(SaltedRequest(request.raw), block_ids)

    @hookimpl
    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        # The chain passes only this node's group (Capabilities kv_cache_groups="one").
        if len(block_ids) != 1:
            raise InvalidKVCacheGroup(
                "lmcache: expected the block ids of one KV cache group, "
                f"got {len(block_ids)} groups"
            )
        self.salts.pop(request.request_id, None)
        return self.impl.request_finished(SaltedRequest(request.raw), block_ids[0])

    @hookimpl
    def shutdown(self) -> None:
        self.impl.shutdown()
