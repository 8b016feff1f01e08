"""The hook specification: what a KV Composer plugin can implement.

Two kinds of hooks live here.

* **Discovery hooks** (module level, found through the ``kv_composer`` entry-point
  group) register plugin *types*.
* **Lifecycle hooks** (:class:`NodeSpec`) are implemented by plugin *instances*,
  one per pipeline node and vLLM process. Their names are vLLM's own
  ``KVConnectorBase_V1`` method names, grouped by phase like pytest's hooks.

A node implements only the hooks it needs; the chain calls the others on no one.
Hooks receive small stable views (:mod:`composer.views`); the raw vLLM object is
passed alongside (``raw`` / ``blocks`` / ``scheduler_output``) as an escape hatch
that a hookimpl asks for by naming the argument.

"Combine" in each docstring says how the results of several nodes are merged
into what the composed connector returns to vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    # vLLM's objects, named for readers and type checkers; never imported at run
    # time (validation and `import composer` stay free of torch and vLLM).
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
    from composer.views import RequestView, StepView

PROJECT = "kv_composer"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------- #
# Discovery (module level, entry-point group ``kv_composer``)
# --------------------------------------------------------------------------- #


class DiscoverySpec:
    @hookspec
    def register_plugin_types(self, register: Callable[[PluginType], None]) -> None:
        """Call ``register(PluginType(...))`` once for every plugin type this package provides."""


# --------------------------------------------------------------------------- #
# Lifecycle (implemented by node instances)
# --------------------------------------------------------------------------- #


class NodeSpec:
    # -- phase 1: initialize (worker, once) ---------------------------------- #

    @hookspec
    def initialize_worker_connector(
        self, model: torch.nn.Module, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        """Worker, once, after the model is loaded: the model, vLLM config and KV cache config.

        Called for every node, in pipeline order, before ``register_kv_caches``
        (on vLLM versions without the hook the adapter delivers it itself).
        """

    @hookspec
    def get_mem_pool_context(self) -> Any | None:
        """Worker, once, before KV caches are allocated: a memory-pool context or None.

        Combine: at most one node may return a context (checked at validation
        through the ``provides_memory_pool`` capability, and again at runtime).
        """

    @hookspec
    def register_kv_caches(
        self, kv_caches: CanonicalKVCaches, raw: dict[str, torch.Tensor]
    ) -> None:
        """Worker, once: the canonical KV cache view, plus vLLM's layer-name -> tensor dict."""

    @hookspec
    def set_host_xfer_buffer_ops(self, copy_operation: Callable[..., None]) -> None:
        """Worker, once: vLLM's host<->device block copy op (used by host-buffer transports)."""

    @hookspec
    def get_handshake_metadata(self) -> Any | None:
        """Worker, once: out-of-band handshake metadata. Combine: first non-None, in node order."""

    # -- phase 2: scheduler side, per request -------------------------------- #

    @hookspec
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Scheduler, once: vLLM's KV cache manager (an escape hatch; most nodes never need it)."""

    @hookspec
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Scheduler, once: vLLM's device block pool (escape hatch)."""

    @hookspec
    def on_new_request(self, request: RequestView) -> None:
        """Scheduler, when a request is added. Every node, in node order."""

    @hookspec
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler: (tokens this node can load beyond ``num_computed_tokens``, load async?).

        ``None`` tokens means "still looking up; ask again". Combine: asked in
        load order; ``None`` from any node makes the answer ``None``; the load
        policy (first hit, longest hit) picks the node that serves the request.
        Must be side-effect free: vLLM may ask more than once.
        """

    @hookspec
    def update_state_after_alloc(
        self,
        request: RequestView,
        block_ids: tuple[list[int], ...],
        num_external_tokens: int,
        blocks: KVCacheBlocks,
    ) -> None:
        """Scheduler, after blocks are allocated: the chosen node gets its token count, others 0.

        ``block_ids`` holds the request's block ids per KV cache group;
        ``blocks`` is vLLM's ``KVCacheBlocks`` (escape hatch).
        """

    @hookspec
    def get_loaded_kv_cache_group_ids(self, request: RequestView) -> tuple[int, ...] | None:
        """Scheduler: the KV cache groups this node's load restores. Asked of the chosen node."""

    @hookspec
    def get_external_cache_hit_sources(
        self, request: RequestView, num_external_tokens: int
    ) -> dict[Any, int] | None:
        """Scheduler: split the loaded tokens by cache source. Asked of the chosen node only."""

    @hookspec
    def build_connector_meta(self, step: StepView, scheduler_output: SchedulerOutput) -> Any:
        """Scheduler, every step: this node's metadata (picklable) for its worker half.

        Combine: one entry per node, delivered to the same node on the worker
        by ``bind_connector_metadata``.
        """

    @hookspec
    def update_connector_output(
        self, connector_output: KVConnectorOutput, worker_meta: Any
    ) -> None:
        """Scheduler, every step: the workers' output, with this node's own worker metadata.

        ``worker_meta`` is what this node's ``build_connector_worker_meta``
        returned on the workers (combined with ``aggregate`` across workers), or None;
        inside vLLM it is also ``connector_output.kv_connector_worker_meta`` during
        the call, as MultiConnector's children see it.
        """

    @hookspec
    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per finished request: (hold blocks until saved?, kv_transfer_params).

        Combine: blocks are held until every node that said True reports the
        request in ``get_finished``; transfer params are merged and a key
        written by two nodes is an error.
        """

    @hookspec
    def request_finished_all_groups(
        self, request: RequestView, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, HMA only: ``request_finished`` with the block ids of the node's groups.

        A node without it gets ``request_finished`` with its first group's block ids.
        """

    @hookspec
    def register_finished_partial_tail(
        self,
        request: RequestView,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        """Scheduler: accept finish-time partial-tail sources? Combine: any True holds blocks."""

    @hookspec
    def take_events(self) -> Iterable[Any]:
        """Scheduler, every step: new KV cache events. Combine: concatenated in node order.

        An event with an ``ownership`` field left None (vLLM's ``BlockStored``,
        ``BlockRemoved``: the offloading tier that made it) gets the node id.
        """

    @hookspec
    def has_pending_block_frees(self) -> bool:
        """Scheduler: pending transfers will free blocks soon. Combine: any."""

    @hookspec
    def has_pending_push_work(self) -> bool:
        """Scheduler: push work needs the engine loop to keep stepping. Combine: any."""

    @hookspec
    def get_finished_count(self) -> int | None:
        """Scheduler: completions expected per request. Combine: all equal, or None."""

    @hookspec
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Scheduler: handshake metadata of all workers, keyed by tp rank."""

    @hookspec
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Scheduler: handshake metadata keyed by (pp rank, tp rank)."""

    @hookspec
    def reset_cache(self) -> bool | None:
        """Either side: drop cached KV. Combine: True unless a node returns False."""

    # -- phase 3: worker side, per step --------------------------------------- #

    @hookspec
    def handle_preemptions(self, metadata: Any) -> None:
        """Worker, every step before the forward: this node's metadata, for preempted requests."""

    @hookspec
    def bind_connector_metadata(self, metadata: Any) -> None:
        """Worker, every step before the forward: this node's ``build_connector_meta`` result."""

    @hookspec
    def start_load_kv(self, forward_context: ForwardContext) -> None:
        """Worker, before the forward: start (or do) this node's loads into vLLM's KV cache.

        A node that raises here turns the blocks it was to load into load errors.
        """

    @hookspec
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, per attention layer, hot path: block until this layer's load is done."""

    @hookspec
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        """Worker, per attention layer, hot path: start saving this layer's KV."""

    @hookspec
    def wait_for_save(self) -> None:
        """Worker, every step after the forward: submit saves; sync ones finish before return."""

    @hookspec
    def finish_forward(self) -> None:
        """Worker: the model no longer reads this step's KV."""

    @hookspec
    def reset_capture_state(self) -> None:
        """Worker: reset state mutated while capturing CUDA graphs."""

    @hookspec
    def clear_connector_metadata(self) -> None:
        """Worker, every step after the forward: drop this step's metadata."""

    @hookspec
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step: (requests done saving, requests done loading).

        Combine: a request is done saving when every node that held it says so.
        """

    @hookspec
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Worker, every step: finished sends / receives and failed receives (vLLM's
        ``KVConnectorTransferResults``). Nodes without it fall back to ``get_finished``.
        """

    @hookspec
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step: block ids that failed to load. Combine: union."""

    @hookspec
    def build_connector_worker_meta(self) -> Any | None:
        """Worker, every step: metadata for this node's scheduler half (``worker_meta``)."""

    # -- phase 4: stats, events, shutdown ------------------------------------- #

    @hookspec
    def get_kv_connector_stats(self) -> Any | None:
        """Worker: stats since the last call (``KVConnectorStats`` or a dict). Per node id."""

    @hookspec
    def get_kv_connector_kv_cache_events(self) -> Any | None:
        """Worker: KV cache events since the last call. Per node id."""

    @hookspec
    def shutdown(self) -> None:
        """Either side, once: release resources. Every node is called even if one raises."""


#: Lifecycle hooks called per attention layer: dispatched through bound call lists.
PER_LAYER_HOOKS = ("wait_for_layer_load", "save_kv_layer")


class Combine(StrEnum):
    """How the chain combines the nodes' results of one hook into what vLLM gets."""

    CALL_EACH = "call each"
    """Every implementing node is called in order; nothing is returned."""
    AT_MOST_ONE = "at most one"
    """The one non-None result, or None; two non-None results are an error."""
    FIRST_NOT_NONE = "first not None"
    """The first non-None result in node order, or None."""
    CHOSEN_NODE = "chosen node"
    """Only the node serving the request is asked; its answer, or vLLM's default."""
    LOAD_POLICY = "load policy"
    """Asked in load order: None from any node is None; else the first (or longest) hit."""
    ANY_TRUE = "any true"
    """True if any node returns True (every node is still asked)."""
    NOT_ANY_FALSE = "not any false"
    """True unless some node returns False."""
    ALL_EQUAL = "all equal"
    """The common value; None if any node says None; different values are an error."""
    UNION = "union"
    """The union of the nodes' sets."""
    CONCATENATE = "concatenate"
    """The nodes' iterables, one after the other, in node order."""
    MERGE = "merge"
    """``a.merge(b)`` over the non-None results, in node order."""
    HOLD_ANY_PARAMS_NO_CLASH = "hold if any, params merged without clash"
    """(any node holds, merged params); a params key written by two nodes is an error."""
    PER_NODE = "per node"
    """A dict keyed by node id, delivered back to the same node (in the other process)."""
    DONE_WHEN_ALL_HOLDERS = "done when all holders are"
    """Finished loads: union; finished saves: a request when every node holding it is."""


#: Each lifecycle hook's combine rule: the single source the chain follows (and
#: ``tests/test_combine.py`` checks the chain against).
COMBINE: dict[str, Combine] = {
    "initialize_worker_connector": Combine.CALL_EACH,
    "get_mem_pool_context": Combine.AT_MOST_ONE,
    "register_kv_caches": Combine.CALL_EACH,
    "set_host_xfer_buffer_ops": Combine.CALL_EACH,
    "get_handshake_metadata": Combine.FIRST_NOT_NONE,
    "bind_kv_cache_manager": Combine.CALL_EACH,
    "bind_gpu_block_pool": Combine.CALL_EACH,
    "on_new_request": Combine.CALL_EACH,
    "get_num_new_matched_tokens": Combine.LOAD_POLICY,
    "update_state_after_alloc": Combine.CALL_EACH,
    "get_loaded_kv_cache_group_ids": Combine.CHOSEN_NODE,
    "get_external_cache_hit_sources": Combine.CHOSEN_NODE,
    "build_connector_meta": Combine.PER_NODE,
    "update_connector_output": Combine.CALL_EACH,
    "request_finished": Combine.HOLD_ANY_PARAMS_NO_CLASH,
    "request_finished_all_groups": Combine.HOLD_ANY_PARAMS_NO_CLASH,
    "register_finished_partial_tail": Combine.ANY_TRUE,
    "take_events": Combine.CONCATENATE,
    "has_pending_block_frees": Combine.ANY_TRUE,
    "has_pending_push_work": Combine.ANY_TRUE,
    "get_finished_count": Combine.ALL_EQUAL,
    "set_xfer_handshake_metadata": Combine.CALL_EACH,
    "set_xfer_handshake_metadata_pp_aware": Combine.CALL_EACH,
    "reset_cache": Combine.NOT_ANY_FALSE,
    "handle_preemptions": Combine.CALL_EACH,
    "bind_connector_metadata": Combine.CALL_EACH,
    "start_load_kv": Combine.CALL_EACH,
    "wait_for_layer_load": Combine.CALL_EACH,
    "save_kv_layer": Combine.CALL_EACH,
    "wait_for_save": Combine.CALL_EACH,
    "finish_forward": Combine.CALL_EACH,
    "reset_capture_state": Combine.CALL_EACH,
    "clear_connector_metadata": Combine.CALL_EACH,
    "get_finished": Combine.DONE_WHEN_ALL_HOLDERS,
    "get_transfer_results": Combine.DONE_WHEN_ALL_HOLDERS,
    "get_block_ids_with_load_errors": Combine.UNION,
    "build_connector_worker_meta": Combine.PER_NODE,
    "get_kv_connector_stats": Combine.PER_NODE,
    "get_kv_connector_kv_cache_events": Combine.MERGE,
    "shutdown": Combine.CALL_EACH,
}
