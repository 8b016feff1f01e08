"""The hook specification: what a KV Composer plugin can implement.

* **Discovery hooks** (module level, found through the ``kv_composer`` entry-point
  group) register plugin *types* and cache policies (:mod:`composer.policy`).
* **Lifecycle hooks** (:class:`NodeSpec`) are implemented by plugin *instances*,
  one per pipeline node and vLLM process, each only those it needs: vLLM's own
  ``KVConnectorBase_V1`` method names, grouped by phase like pytest's hooks.

Hooks receive small stable views (:mod:`composer.views`); vLLM's raw object is
passed alongside (``raw`` / ``blocks`` / ``scheduler_output``) to a hookimpl that
names the argument. A lifecycle hook's behaviour is its row of the hook table
(:mod:`composer.hook_table`), declared on its spec with ``@hook(...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import pluggy

from composer import hook_table
from composer.hook_table import Away, Combine, Every, Native, Nodes, Process, Recompute, hooks_where

if TYPE_CHECKING:
    # vLLM's objects, for readers and type checkers (`import composer` loads no vLLM).
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput

    from composer.kv_caches import CanonicalKVCaches
    from composer.plugin_types import PluginType
    from composer.policy import CachePolicy
    from composer.views import RequestView, StepView

PROJECT = "kv_composer"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- Discovery (module level, entry-point group ``kv_composer``) ------------- #


class DiscoverySpec:
    @hookspec
    def register_plugin_types(self, register: Callable[[PluginType], None]) -> None:
        """Call ``register(PluginType(...))`` once for every plugin type this package provides."""

    @hookspec
    def register_cache_policies(self, register: Callable[[CachePolicy], None]) -> None:
        """Call ``register(CachePolicy(...))`` once for every cache policy this package provides."""


# -- Lifecycle (implemented by node instances) ------------------------------- #


def hook(*cells: Any, **options: Any) -> Callable[[hook_table.Spec], hook_table.Spec]:
    """``@hookspec``, with the hook's row of the table (:func:`composer.hook_table.row`)."""
    return lambda spec: hookspec(hook_table.row(*cells, **options)(spec))


class NodeSpec:
    # -- phase 1: initialize (worker, once) ---------------------------------- #

    @hook(Process.WORKER, Every.ONCE, Combine.CALL_EACH, Native.NOT)
    def initialize_worker_connector(
        self, model: torch.nn.Module, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        """Worker, once, after the model is loaded: the model, vLLM config and KV cache config.

        Called for every node, in pipeline order, before ``register_kv_caches``
        (on vLLM versions without the hook the adapter delivers it itself).
        """

    @hook(Process.WORKER, Every.ONCE, Combine.AT_MOST_ONE, Native.AS_IS)
    def get_mem_pool_context(self) -> Any | None:
        """Worker, once, before KV caches are allocated: a memory-pool context or None.

        Combine: at most one node may return a context (checked at validation
        through the ``provides_memory_pool`` capability, and again at runtime).
        """

    @hook(Process.WORKER, Every.ONCE, Combine.CALL_EACH, Native.ADAPTED)
    def register_kv_caches(
        self, kv_caches: CanonicalKVCaches, raw: dict[str, torch.Tensor]
    ) -> None:
        """Worker, once: the canonical KV cache view, plus vLLM's layer-name -> tensor dict."""

    @hook(Process.WORKER, Every.ONCE, Combine.CALL_EACH, Native.AS_IS)
    def set_host_xfer_buffer_ops(self, copy_operation: Callable[..., None]) -> None:
        """Worker, once: vLLM's host<->device block copy op (used by host-buffer transports)."""

    @hook(Process.WORKER, Every.ONCE, Combine.FIRST_NOT_NONE, Native.AS_IS)
    def get_handshake_metadata(self) -> Any | None:
        """Worker, once: out-of-band handshake metadata. Combine: first non-None, in node order."""

    # -- sleep mode (worker, around vLLM's sleep and wake-up) ------------------ #

    @hook(Process.WORKER, Every.ON_DEMAND, Combine.CALL_EACH, Native.AS_IS, skip_if_default=True)
    def unregister_kv_caches(self) -> None:
        """Worker, before vLLM sleeps: end transfers, drop views of vLLM's KV caches.

        What a tier stores stays. Also called before vLLM discards its KV cache.
        vLLM has drained its own transfers; its KV memory is released (and later
        remapped) after the call. The chain calls it once per sleep, however
        often vLLM does. A node that implements ``register_kv_caches`` without
        this hook and ``restore_kv_caches`` cannot sleep (``kvc serve
        --enable-sleep-mode`` refuses the pipeline).
        """

    @hook(Process.WORKER, Every.ON_DEMAND, Combine.CALL_EACH, Native.DIRECT, skip_if_default=True)
    def restore_kv_caches(self, kv_caches: CanonicalKVCaches, raw: dict[str, torch.Tensor]) -> None:
        """Worker, after vLLM wakes up: the KV caches again, as in ``register_kv_caches``.

        Their contents are gone (vLLM recomputes or reloads what it needs); a
        node takes its views and registrations again. Once per wake-up.
        """

    # -- phase 2: scheduler side, per request -------------------------------- #

    @hook(Process.SCHEDULER, Every.ONCE, Combine.CALL_EACH, Native.AS_IS)
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Scheduler, once: vLLM's KV cache manager (an escape hatch; most nodes never need it)."""

    @hook(Process.SCHEDULER, Every.ONCE, Combine.CALL_EACH, Native.NOT)
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Scheduler, once: vLLM's device block pool (escape hatch)."""

    @hook(
        Process.SCHEDULER,
        Every.REQUEST,
        Combine.CALL_EACH,
        Native.ADAPTED,
        recompute=Recompute.RESULT_LOST,
        skip_if_default=True,
    )
    def on_new_request(self, request: RequestView) -> None:
        """Scheduler, when a request is added. Every node, in node order."""

    @hook(
        Process.SCHEDULER,
        Every.REQUEST,
        Combine.LOAD_POLICY,
        Native.ADAPTED,
        recompute=Recompute.RESULT_LOST,
        away=Away.MISS,
        nodes=Nodes.LOADERS_IN_LOAD_ORDER,
        store_call=True,
    )
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler: (tokens this node can load beyond ``num_computed_tokens``, load async?).

        ``None`` tokens means "still looking up; ask again". Combine: asked in
        load order; ``None`` from any node makes the answer ``None``; the load
        policy (first hit, longest hit) picks the node that serves the request,
        or (ranges) each node is asked from where the previous nodes' hits end
        (``num_computed_tokens``) and serves its own range.
        Must be side-effect free: vLLM may ask more than once.
        """

    @hook(Process.SCHEDULER, Every.REQUEST, Combine.CALL_EACH, Native.ADAPTED)
    def update_state_after_alloc(
        self,
        request: RequestView,
        block_ids: tuple[list[int], ...],
        num_external_tokens: int,
        blocks: KVCacheBlocks,
    ) -> None:
        """Scheduler, after blocks are allocated: each range's node gets its tokens, others 0.

        ``block_ids`` holds the request's block ids per KV cache group;
        ``blocks`` is vLLM's ``KVCacheBlocks`` (escape hatch); ``request.loads``
        the request's ranges, ``(node id, start token, tokens)`` each.
        """

    @hook(Process.SCHEDULER, Every.REQUEST, Combine.CHOSEN_NODE, Native.ADAPTED)
    def get_loaded_kv_cache_group_ids(self, request: RequestView) -> tuple[int, ...] | None:
        """Scheduler: the KV cache groups this node's load restores. Asked of the chosen node."""

    @hook(Process.SCHEDULER, Every.REQUEST, Combine.CHOSEN_NODE, Native.ADAPTED)
    def get_external_cache_hit_sources(
        self, request: RequestView, num_external_tokens: int
    ) -> dict[Any, int] | None:
        """Scheduler: split the loaded tokens by cache source. Asked of the chosen node only."""

    @hook(Process.SCHEDULER, Every.STEP, Combine.PER_NODE, Native.DIRECT)
    def build_connector_meta(self, step: StepView, scheduler_output: SchedulerOutput) -> Any:
        """Scheduler, every step: this node's metadata (picklable) for its worker half.

        Combine: one entry per node, delivered to the same node on the worker
        by ``bind_connector_metadata``.
        """

    @hook(Process.SCHEDULER, Every.STEP, Combine.CALL_EACH, Native.DIRECT)
    def update_connector_output(
        self, connector_output: KVConnectorOutput, worker_meta: Any
    ) -> None:
        """Scheduler, every step: the workers' output, with this node's own worker metadata.

        ``worker_meta`` is what this node's ``build_connector_worker_meta``
        returned on the workers (combined with ``aggregate`` across workers), or None;
        inside vLLM it is also ``connector_output.kv_connector_worker_meta`` during
        the call, as MultiConnector's children see it.
        """

    @hook(
        Process.SCHEDULER,
        Every.REQUEST,
        Combine.HOLD_ANY_PARAMS_NO_CLASH,
        Native.ADAPTED,
        away=Away.SAVE_SKIPPED,
    )
    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per finished request: (hold blocks until saved?, kv_transfer_params).

        ``None`` is ``(False, None)``: nothing held, no params. Combine: blocks
        are held until every node that said True reports the request in
        ``get_finished``; transfer params are merged and a key written by two
        nodes is an error, but ``kv_composer``: a node says something of the request
        there under an entry of its own (``{"kv_composer": {"retention": {node: ...}}}``).
        """

    @hook(
        Process.SCHEDULER,
        Every.REQUEST,
        Combine.HOLD_ANY_PARAMS_NO_CLASH,
        Native.ADAPTED,
        away=Away.SAVE_SKIPPED,
    )
    def request_finished_all_groups(
        self, request: RequestView, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, HMA only: ``request_finished`` with the block ids of the node's groups.

        A node without it gets ``request_finished`` with its first group's block ids.
        """

    @hook(Process.SCHEDULER, Every.REQUEST, Combine.ANY_TRUE, Native.ADAPTED)
    def register_finished_partial_tail(
        self,
        request: RequestView,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        """Scheduler: accept finish-time partial-tail sources? Combine: any True holds blocks."""

    @hook(
        Process.SCHEDULER,
        Every.STEP,
        Combine.CONCATENATE,
        Native.AS_IS,
        recompute=Recompute.RESULT_LOST,
        skip_if_default=True,
    )
    def take_events(self) -> Iterable[Any]:
        """Scheduler, every step: new KV cache events. Combine: concatenated in node order.

        An event with an ``ownership`` field left None (vLLM's ``BlockStored``,
        ``BlockRemoved``: the offloading tier that made it) gets the node id.
        """

    @hook(
        Process.SCHEDULER,
        Every.STEP,
        Combine.ANY_TRUE,
        Native.AS_IS,
        recompute=Recompute.RESULT_LOST,
        skip_if_default=True,
    )
    def has_pending_block_frees(self) -> bool:
        """Scheduler: pending transfers will free blocks soon. Combine: any."""

    @hook(
        Process.SCHEDULER,
        Every.STEP,
        Combine.ANY_TRUE,
        Native.AS_IS,
        recompute=Recompute.RESULT_LOST,
        skip_if_default=True,
    )
    def has_pending_push_work(self) -> bool:
        """Scheduler: push work needs the engine loop to keep stepping. Combine: any."""

    @hook(Process.SCHEDULER, Every.ONCE, Combine.ALL_EQUAL, Native.AS_IS)
    def get_finished_count(self) -> int | None:
        """Scheduler: completions expected per request. Combine: all equal, or None."""

    @hook(Process.SCHEDULER, Every.ONCE, Combine.CALL_EACH, Native.AS_IS)
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Scheduler: handshake metadata of all workers, keyed by tp rank."""

    @hook(Process.SCHEDULER, Every.ONCE, Combine.CALL_EACH, Native.AS_IS)
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Scheduler: handshake metadata keyed by (pp rank, tp rank)."""

    @hook(
        Process.EITHER,
        Every.ON_DEMAND,
        Combine.NOT_ANY_FALSE,
        Native.AS_IS,
        recompute=Recompute.RESULT_LOST,
    )
    def reset_cache(self) -> bool | None:
        """Either side: drop cached KV. Combine: True unless a node returns False."""

    # -- phase 3: worker side, per step --------------------------------------- #

    @hook(Process.WORKER, Every.STEP, Combine.CALL_EACH, Native.AS_IS, skip_if_default=True)
    def handle_preemptions(self, metadata: Any) -> None:
        """Worker, every step before the forward: this node's metadata, for preempted requests."""

    @hook(Process.WORKER, Every.STEP, Combine.CALL_EACH, Native.AS_IS)
    def bind_connector_metadata(self, metadata: Any) -> None:
        """Worker, every step before the forward: this node's ``build_connector_meta`` result."""

    @hook(
        Process.WORKER,
        Every.STEP,
        Combine.CALL_EACH,
        Native.AS_IS,
        recompute=Recompute.BLOCKS_RECOMPUTED,
        nodes=Nodes.LOADERS,
        store_call=True,
        passes_kwargs=True,
    )
    def start_load_kv(self, forward_context: ForwardContext) -> None:
        """Worker, before the forward: start (or do) this node's loads into vLLM's KV cache.

        A node that raises here turns the blocks it was to load into load errors.
        """

    @hook(
        Process.WORKER,
        Every.LAYER,
        Combine.CALL_EACH,
        Native.AS_IS,
        recompute=Recompute.BLOCKS_RECOMPUTED,
        nodes=Nodes.LOADERS,
    )
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, per attention layer, hot path: block until this layer's load is done."""

    @hook(
        Process.WORKER,
        Every.LAYER,
        Combine.CALL_EACH,
        Native.AS_IS,
        away=Away.SAVE_SKIPPED,
        nodes=Nodes.SAVERS,
        passes_kwargs=True,
    )
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        """Worker, per attention layer, hot path: start saving this layer's KV."""

    @hook(
        Process.WORKER,
        Every.STEP,
        Combine.CALL_EACH,
        Native.AS_IS,
        away=Away.SAVE_SKIPPED,
        nodes=Nodes.SAVERS,
        store_call=True,
    )
    def wait_for_save(self) -> None:
        """Worker, every step after the forward: submit saves; sync ones finish before return."""

    @hook(Process.WORKER, Every.STEP, Combine.CALL_EACH, Native.AS_IS, skip_if_default=True)
    def finish_forward(self) -> None:
        """Worker: the model no longer reads this step's KV."""

    @hook(Process.WORKER, Every.ON_DEMAND, Combine.CALL_EACH, Native.AS_IS, skip_if_default=True)
    def reset_capture_state(self) -> None:
        """Worker: reset state mutated while capturing CUDA graphs."""

    @hook(Process.WORKER, Every.STEP, Combine.CALL_EACH, Native.AS_IS)
    def clear_connector_metadata(self) -> None:
        """Worker, every step after the forward: drop this step's metadata."""

    @hook(Process.WORKER, Every.STEP, Combine.DONE_WHEN_ALL_HOLDERS, Native.NOT)
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step: (requests done saving, requests done loading).

        Combine: a request is done saving when every node that held it says so.
        """

    @hook(
        Process.WORKER,
        Every.STEP,
        Combine.DONE_WHEN_ALL_HOLDERS,
        Native.AS_IS,
        skip_if_default=("get_transfer_results", "get_finished"),
    )
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Worker, every step: finished sends / receives and failed receives (vLLM's
        ``KVConnectorTransferResults``). Nodes without it fall back to ``get_finished``.
        """

    @hook(Process.WORKER, Every.STEP, Combine.UNION, Native.AS_IS, skip_if_default=True)
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step: block ids that failed to load. Combine: union."""

    @hook(Process.WORKER, Every.STEP, Combine.PER_NODE, Native.AS_IS, skip_if_default=True)
    def build_connector_worker_meta(self) -> Any | None:
        """Worker, every step: metadata for this node's scheduler half (``worker_meta``)."""

    # -- phase 4: stats, events, shutdown ------------------------------------- #

    @hook(
        Process.EITHER,
        Every.STEP,
        Combine.PER_NODE,
        Native.AS_IS,
        recompute=Recompute.RESULT_LOST,
        skip_if_default=True,
    )
    def get_kv_connector_stats(self) -> Any | None:
        """Either side: stats since the last call (``KVConnectorStats`` or a dict). Per node id."""

    @hook(
        Process.WORKER,
        Every.STEP,
        Combine.MERGE,
        Native.AS_IS,
        recompute=Recompute.RESULT_LOST,
        skip_if_default=True,
    )
    def get_kv_connector_kv_cache_events(self) -> Any | None:
        """Worker: KV cache events since the last call. Combine: merged, in node order."""

    @hook(Process.EITHER, Every.ONCE, Combine.CALL_EACH, Native.AS_IS)
    def shutdown(self) -> None:
        """Either side, once: release resources. Every node is called even if one raises."""


#: A node's lookup, load and save of a step: each a hook whose ``Unavailable`` is an
#: outage, not a fault (derived here, where the table is complete).
STORE_CALLS = frozenset(hooks_where(store_call=True))
