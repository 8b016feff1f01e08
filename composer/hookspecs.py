"""The hook specification: what a KV Composer plugin can implement.

Two kinds of hooks live here.

* **Discovery hooks** (module level, found through the ``kv_composer`` entry-point
  group) register plugin *types* and cache policies (:mod:`composer.policy`).
* **Lifecycle hooks** (:class:`NodeSpec`) are implemented by plugin *instances*,
  one per pipeline node and vLLM process. Their names are vLLM's own
  ``KVConnectorBase_V1`` method names, grouped by phase like pytest's hooks.

A node implements only the hooks it needs; the chain calls the others on no one.
Hooks receive small stable views (:mod:`composer.views`); the raw vLLM object is
passed alongside (``raw`` / ``blocks`` / ``scheduler_output``) as an escape hatch
that a hookimpl asks for by naming the argument.

Each lifecycle hook's behaviour is declared once, on its spec (``@hook(...)``,
the way pytest declares ``firstresult`` on a hookspec): which vLLM process calls
it and how often, how the nodes' results combine, what ``on_error: recompute``
does with a failure, which nodes it is dispatched to, and how the built-in
``vllm`` node forwards it. :data:`HOOKS` holds those rows; the chain's call
lists, fault policy and step timing, the native node's forwarding, the docs'
hook table (:func:`markdown_table`) and the combine and fault tests all read it.

Adding a hook (as vLLM adds a connector method), each step checked by a test:

1. its spec here, with its row (``@hook(...)``); paste :func:`markdown_table`
   into ``docs/hooks.md``;
2. the method of the same name on the chain of the process that calls it
   (``SchedulerChain``, ``WorkerChain``, or ``ChainCore`` for either, in
   ``chain/``), which ``ComposedConnector``'s method of that name calls;
3. its vLLM arguments in :func:`composer.testing.chains.sample_args`, with
   which the combine and fault tests drive it;
4. for the ``vllm`` node: nothing when its row says ``as is``; a hookimpl on
   ``NativeConnectorNode`` taking vLLM's arguments when ``direct``, or
   converting them when ``adapted``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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
    from composer.policy import CachePolicy
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

    @hookspec
    def register_cache_policies(self, register: Callable[[CachePolicy], None]) -> None:
        """Call ``register(CachePolicy(...))`` once for every cache policy this package provides."""


# --------------------------------------------------------------------------- #
# Lifecycle (implemented by node instances): a hook's behaviour, one row per
# hook, declared on its spec
# --------------------------------------------------------------------------- #


class Process(StrEnum):
    """The vLLM process that calls a hook."""

    SCHEDULER = "scheduler"
    WORKER = "worker"
    EITHER = "either"


class Every(StrEnum):
    """How often vLLM calls a hook. Per-layer and per-step hooks are timed in the
    per-node stats only with ``time_layer_hooks`` / ``time_step_hooks``; the rest always."""

    ONCE = "once"
    ON_DEMAND = "on demand"
    REQUEST = "per request"
    STEP = "per step"
    LAYER = "per layer"


class Combine(StrEnum):
    """How the chain combines the nodes' results of one hook into what vLLM gets."""

    CALL_EACH = "call each"
    """Every implementing node is called in order; nothing is returned."""
    AT_MOST_ONE = "at most one"
    """The one non-None result, or None; two non-None results are an error."""
    FIRST_NOT_NONE = "first not None"
    """The first non-None result in node order, or None."""
    CHOSEN_NODE = "chosen node"
    """Only the nodes serving the request are asked (one per range); the answer, or
    vLLM's default (several ranges: hit sources summed, KV cache groups united)."""
    LOAD_POLICY = "load policy"
    """Asked in load order: None from any node is None; else the first or longest hit,
    or under ``ranges`` each node's hit after the nodes before it, summed."""
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
    """(any node holds, merged params); a params key written by two nodes is an error, but
    ``kv_composer``, whose entries (one per node under a key, ``retention.<node>``)
    are merged beside the chain's note."""
    PER_NODE = "per node"
    """A dict keyed by node id, delivered back to the same node (in the other process)."""
    DONE_WHEN_ALL_HOLDERS = "done when all holders are"
    """Finished loads: union; finished saves: a request when every node holding it is."""


class Recompute(StrEnum):
    """What a node's failure in a hook does under ``on_error: recompute``."""

    SWITCH_OFF = "switched off"
    """The node's two halves may be out of step, or a transfer still in flight, and
    vLLM has no call that cancels either: the node is switched off, as ``disable``."""
    RESULT_LOST = "result lost"
    """Only this call's result is lost (a lookup is a miss, a report is skipped)."""
    BLOCKS_RECOMPUTED = "blocks recomputed"
    """The blocks the node loads this step become load errors, which vLLM recomputes;
    switched off instead while the node has an async load in flight."""


class Away(StrEnum):
    """What a node's :class:`~composer.Unavailable` (its store is away) does in a hook.
    Not a fault: under every ``on_error`` policy the node stays on and is counted."""

    MISS = "a miss"
    """The lookup found nothing; vLLM computes the request."""
    RESULT_LOST = "result lost"
    """Only this call's result is lost (a report is skipped)."""
    BLOCKS_RECOMPUTED = "blocks recomputed"
    """The blocks the node loads this step become load errors, which vLLM recomputes
    (the node still reports finished any async load it had started)."""
    SAVE_SKIPPED = "save skipped"
    """Nothing is saved and the request's blocks are not held for the node."""
    FAULT = "a fault"
    """The hook has no such meaning (the node's two halves could be out of step):
    the node's ``on_error`` applies."""


class Nodes(StrEnum):
    """The nodes a hook is dispatched to, and in which order."""

    ALL = "every node"
    """Every node, in pipeline order."""
    LOADERS_IN_LOAD_ORDER = "load order"
    """The nodes of ``load_order``, in that order (a lookup asks them so)."""
    LOADERS = "loaders"
    """The nodes of ``load_order``, in pipeline order."""
    SAVERS = "savers"
    """The nodes of ``save_to``, in pipeline order."""


class Native(StrEnum):
    """How the built-in ``vllm`` node forwards a hook to its vLLM connector."""

    AS_IS = "as is"
    """vLLM's method of the same name takes the spec's arguments: a generated
    hookimpl, and a direct call to the connector's method in the call list."""
    DIRECT = "direct"
    """The node's hookimpl takes exactly vLLM's arguments (a subset of the spec's):
    a direct call to the connector's method in the call list."""
    ADAPTED = "adapted"
    """The node's hookimpl converts the arguments (a request view's raw request, ...)."""
    NOT = "not forwarded"
    """vLLM's connectors have no such method (or the chain asks another one)."""


@dataclass(frozen=True)
class Hook:
    """One lifecycle hook's row of the table."""

    name: str
    process: Process
    every: Every
    combine: Combine
    recompute: Recompute
    away: Away
    nodes: Nodes
    native: Native
    #: vLLM base-class methods behind the hook: a ``vllm`` node whose connector
    #: keeps vLLM's do-nothing default for all of them is left out of the call list.
    skip_if_default: tuple[str, ...]
    #: The call reaches the node's store every time it is made, so one that
    #: returns normally ends the node's outage.
    store_call: bool
    #: vLLM's method also takes ``**kwargs`` (0.32.0 passes none; later versions
    #: may): the chain hands them to the nodes' callables that take them.
    passes_kwargs: bool

    @property
    def signature(self) -> str:
        """``name(arg, ...)``: the spec's argument names (a hookimpl names any of them)."""
        return f"{self.name}({', '.join(pluggy_argnames(getattr(NodeSpec, self.name)))})"


#: Every lifecycle hook, in spec order: filled by ``@hook`` as ``NodeSpec`` is defined.
HOOKS: dict[str, Hook] = {}


def hook(
    process: Process,
    every: Every,
    combine: Combine,
    *,
    recompute: Recompute = Recompute.SWITCH_OFF,
    away: Away | None = None,
    nodes: Nodes = Nodes.ALL,
    native: Native,
    skip_if_default: bool | tuple[str, ...] = False,
    store_call: bool = False,
    passes_kwargs: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a lifecycle hookspec and record its row in :data:`HOOKS`.

    ``away`` defaults to what ``recompute`` says: what vLLM's recompute undoes
    after a fault, it undoes after an outage too.
    """
    if away is None:
        away = {
            Recompute.RESULT_LOST: Away.RESULT_LOST,
            Recompute.BLOCKS_RECOMPUTED: Away.BLOCKS_RECOMPUTED,
        }.get(recompute, Away.FAULT)

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__
        skip = (name,) if skip_if_default is True else skip_if_default or ()
        row = (process, every, combine, recompute, away, nodes, native, skip)
        HOOKS[name] = Hook(name, *row, store_call, passes_kwargs)
        return hookspec(fn)

    return mark


def pluggy_argnames(fn: Callable[..., Any]) -> tuple[str, ...]:
    """A hookspec's argument names as pluggy passes them (``self`` left out)."""
    return tuple(inspect.signature(fn).parameters)[1:]


class NodeSpec:
    # -- phase 1: initialize (worker, once) ---------------------------------- #

    @hook(Process.WORKER, Every.ONCE, Combine.CALL_EACH, native=Native.NOT)
    def initialize_worker_connector(
        self, model: torch.nn.Module, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        """Worker, once, after the model is loaded: the model, vLLM config and KV cache config.

        Called for every node, in pipeline order, before ``register_kv_caches``
        (on vLLM versions without the hook the adapter delivers it itself).
        """

    @hook(Process.WORKER, Every.ONCE, Combine.AT_MOST_ONE, native=Native.AS_IS)
    def get_mem_pool_context(self) -> Any | None:
        """Worker, once, before KV caches are allocated: a memory-pool context or None.

        Combine: at most one node may return a context (checked at validation
        through the ``provides_memory_pool`` capability, and again at runtime).
        """

    @hook(Process.WORKER, Every.ONCE, Combine.CALL_EACH, native=Native.ADAPTED)
    def register_kv_caches(
        self, kv_caches: CanonicalKVCaches, raw: dict[str, torch.Tensor]
    ) -> None:
        """Worker, once: the canonical KV cache view, plus vLLM's layer-name -> tensor dict."""

    @hook(Process.WORKER, Every.ONCE, Combine.CALL_EACH, native=Native.AS_IS)
    def set_host_xfer_buffer_ops(self, copy_operation: Callable[..., None]) -> None:
        """Worker, once: vLLM's host<->device block copy op (used by host-buffer transports)."""

    @hook(Process.WORKER, Every.ONCE, Combine.FIRST_NOT_NONE, native=Native.AS_IS)
    def get_handshake_metadata(self) -> Any | None:
        """Worker, once: out-of-band handshake metadata. Combine: first non-None, in node order."""

    # -- sleep mode (worker, around vLLM's sleep and wake-up) ------------------ #

    @hook(
        Process.WORKER,
        Every.ON_DEMAND,
        Combine.CALL_EACH,
        native=Native.AS_IS,
        skip_if_default=True,
    )
    def unregister_kv_caches(self) -> None:
        """Worker, before vLLM sleeps: end transfers, drop views of vLLM's KV caches.

        What a tier stores stays. Also called before vLLM discards its KV cache.
        vLLM has drained its own transfers; its KV memory is released (and later
        remapped) after the call. The chain calls it once per sleep, however
        often vLLM does. A node that implements ``register_kv_caches`` without
        this hook and ``restore_kv_caches`` cannot sleep (``kvc serve
        --enable-sleep-mode`` refuses the pipeline).
        """

    @hook(
        Process.WORKER,
        Every.ON_DEMAND,
        Combine.CALL_EACH,
        native=Native.DIRECT,
        skip_if_default=True,
    )
    def restore_kv_caches(
        self, kv_caches: CanonicalKVCaches, raw: dict[str, torch.Tensor]
    ) -> None:
        """Worker, after vLLM wakes up: the KV caches again, as in ``register_kv_caches``.

        Their contents are gone (vLLM recomputes or reloads what it needs); a
        node takes its views and registrations again. Once per wake-up.
        """

    # -- phase 2: scheduler side, per request -------------------------------- #

    @hook(Process.SCHEDULER, Every.ONCE, Combine.CALL_EACH, native=Native.AS_IS)
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Scheduler, once: vLLM's KV cache manager (an escape hatch; most nodes never need it)."""

    @hook(Process.SCHEDULER, Every.ONCE, Combine.CALL_EACH, native=Native.NOT)
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Scheduler, once: vLLM's device block pool (escape hatch)."""

    @hook(
        Process.SCHEDULER,
        Every.REQUEST,
        Combine.CALL_EACH,
        recompute=Recompute.RESULT_LOST,
        native=Native.ADAPTED,
        skip_if_default=True,
    )
    def on_new_request(self, request: RequestView) -> None:
        """Scheduler, when a request is added. Every node, in node order."""

    @hook(
        Process.SCHEDULER,
        Every.REQUEST,
        Combine.LOAD_POLICY,
        recompute=Recompute.RESULT_LOST,
        away=Away.MISS,
        nodes=Nodes.LOADERS_IN_LOAD_ORDER,
        native=Native.ADAPTED,
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

    @hook(Process.SCHEDULER, Every.REQUEST, Combine.CALL_EACH, native=Native.ADAPTED)
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

    @hook(Process.SCHEDULER, Every.REQUEST, Combine.CHOSEN_NODE, native=Native.ADAPTED)
    def get_loaded_kv_cache_group_ids(self, request: RequestView) -> tuple[int, ...] | None:
        """Scheduler: the KV cache groups this node's load restores. Asked of the chosen node."""

    @hook(Process.SCHEDULER, Every.REQUEST, Combine.CHOSEN_NODE, native=Native.ADAPTED)
    def get_external_cache_hit_sources(
        self, request: RequestView, num_external_tokens: int
    ) -> dict[Any, int] | None:
        """Scheduler: split the loaded tokens by cache source. Asked of the chosen node only."""

    @hook(Process.SCHEDULER, Every.STEP, Combine.PER_NODE, native=Native.DIRECT)
    def build_connector_meta(self, step: StepView, scheduler_output: SchedulerOutput) -> Any:
        """Scheduler, every step: this node's metadata (picklable) for its worker half.

        Combine: one entry per node, delivered to the same node on the worker
        by ``bind_connector_metadata``.
        """

    @hook(Process.SCHEDULER, Every.STEP, Combine.CALL_EACH, native=Native.DIRECT)
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
        away=Away.SAVE_SKIPPED,
        native=Native.ADAPTED,
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
        away=Away.SAVE_SKIPPED,
        native=Native.ADAPTED,
    )
    def request_finished_all_groups(
        self, request: RequestView, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, HMA only: ``request_finished`` with the block ids of the node's groups.

        A node without it gets ``request_finished`` with its first group's block ids.
        """

    @hook(Process.SCHEDULER, Every.REQUEST, Combine.ANY_TRUE, native=Native.ADAPTED)
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
        recompute=Recompute.RESULT_LOST,
        native=Native.AS_IS,
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
        recompute=Recompute.RESULT_LOST,
        native=Native.AS_IS,
        skip_if_default=True,
    )
    def has_pending_block_frees(self) -> bool:
        """Scheduler: pending transfers will free blocks soon. Combine: any."""

    @hook(
        Process.SCHEDULER,
        Every.STEP,
        Combine.ANY_TRUE,
        recompute=Recompute.RESULT_LOST,
        native=Native.AS_IS,
        skip_if_default=True,
    )
    def has_pending_push_work(self) -> bool:
        """Scheduler: push work needs the engine loop to keep stepping. Combine: any."""

    @hook(Process.SCHEDULER, Every.ONCE, Combine.ALL_EQUAL, native=Native.AS_IS)
    def get_finished_count(self) -> int | None:
        """Scheduler: completions expected per request. Combine: all equal, or None."""

    @hook(Process.SCHEDULER, Every.ONCE, Combine.CALL_EACH, native=Native.AS_IS)
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Scheduler: handshake metadata of all workers, keyed by tp rank."""

    @hook(Process.SCHEDULER, Every.ONCE, Combine.CALL_EACH, native=Native.AS_IS)
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Scheduler: handshake metadata keyed by (pp rank, tp rank)."""

    @hook(
        Process.EITHER,
        Every.ON_DEMAND,
        Combine.NOT_ANY_FALSE,
        recompute=Recompute.RESULT_LOST,
        native=Native.AS_IS,
    )
    def reset_cache(self) -> bool | None:
        """Either side: drop cached KV. Combine: True unless a node returns False."""

    # -- phase 3: worker side, per step --------------------------------------- #

    @hook(Process.WORKER, Every.STEP, Combine.CALL_EACH, native=Native.AS_IS, skip_if_default=True)
    def handle_preemptions(self, metadata: Any) -> None:
        """Worker, every step before the forward: this node's metadata, for preempted requests."""

    @hook(Process.WORKER, Every.STEP, Combine.CALL_EACH, native=Native.AS_IS)
    def bind_connector_metadata(self, metadata: Any) -> None:
        """Worker, every step before the forward: this node's ``build_connector_meta`` result."""

    @hook(
        Process.WORKER,
        Every.STEP,
        Combine.CALL_EACH,
        recompute=Recompute.BLOCKS_RECOMPUTED,
        nodes=Nodes.LOADERS,
        native=Native.AS_IS,
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
        recompute=Recompute.BLOCKS_RECOMPUTED,
        nodes=Nodes.LOADERS,
        native=Native.AS_IS,
    )
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, per attention layer, hot path: block until this layer's load is done."""

    @hook(
        Process.WORKER,
        Every.LAYER,
        Combine.CALL_EACH,
        away=Away.SAVE_SKIPPED,
        nodes=Nodes.SAVERS,
        native=Native.AS_IS,
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
        away=Away.SAVE_SKIPPED,
        nodes=Nodes.SAVERS,
        native=Native.AS_IS,
        store_call=True,
    )
    def wait_for_save(self) -> None:
        """Worker, every step after the forward: submit saves; sync ones finish before return."""

    @hook(Process.WORKER, Every.STEP, Combine.CALL_EACH, native=Native.AS_IS, skip_if_default=True)
    def finish_forward(self) -> None:
        """Worker: the model no longer reads this step's KV."""

    @hook(
        Process.WORKER,
        Every.ON_DEMAND,
        Combine.CALL_EACH,
        native=Native.AS_IS,
        skip_if_default=True,
    )
    def reset_capture_state(self) -> None:
        """Worker: reset state mutated while capturing CUDA graphs."""

    @hook(Process.WORKER, Every.STEP, Combine.CALL_EACH, native=Native.AS_IS)
    def clear_connector_metadata(self) -> None:
        """Worker, every step after the forward: drop this step's metadata."""

    @hook(Process.WORKER, Every.STEP, Combine.DONE_WHEN_ALL_HOLDERS, native=Native.NOT)
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step: (requests done saving, requests done loading).

        Combine: a request is done saving when every node that held it says so.
        """

    @hook(
        Process.WORKER,
        Every.STEP,
        Combine.DONE_WHEN_ALL_HOLDERS,
        native=Native.AS_IS,
        skip_if_default=("get_transfer_results", "get_finished"),
    )
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Worker, every step: finished sends / receives and failed receives (vLLM's
        ``KVConnectorTransferResults``). Nodes without it fall back to ``get_finished``.
        """

    @hook(Process.WORKER, Every.STEP, Combine.UNION, native=Native.AS_IS, skip_if_default=True)
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step: block ids that failed to load. Combine: union."""

    @hook(Process.WORKER, Every.STEP, Combine.PER_NODE, native=Native.AS_IS, skip_if_default=True)
    def build_connector_worker_meta(self) -> Any | None:
        """Worker, every step: metadata for this node's scheduler half (``worker_meta``)."""

    # -- phase 4: stats, events, shutdown ------------------------------------- #

    @hook(
        Process.EITHER,
        Every.STEP,
        Combine.PER_NODE,
        recompute=Recompute.RESULT_LOST,
        native=Native.AS_IS,
        skip_if_default=True,
    )
    def get_kv_connector_stats(self) -> Any | None:
        """Either side: stats since the last call (``KVConnectorStats`` or a dict). Per node id."""

    @hook(
        Process.WORKER,
        Every.STEP,
        Combine.MERGE,
        recompute=Recompute.RESULT_LOST,
        native=Native.AS_IS,
        skip_if_default=True,
    )
    def get_kv_connector_kv_cache_events(self) -> Any | None:
        """Worker: KV cache events since the last call. Combine: merged, in node order."""

    @hook(Process.EITHER, Every.ONCE, Combine.CALL_EACH, native=Native.AS_IS)
    def shutdown(self) -> None:
        """Either side, once: release resources. Every node is called even if one raises."""


# --------------------------------------------------------------------------- #
# Derived from the table (nothing below is declared twice)
# --------------------------------------------------------------------------- #


def hooks_where(**row: Any) -> tuple[str, ...]:
    """The hooks whose row has these values, in spec order: ``hooks_where(every=Every.STEP)``."""
    return tuple(
        name for name, h in HOOKS.items() if all(getattr(h, k) == v for k, v in row.items())
    )


#: Each hook's combine rule (``tests/test_combine.py`` checks the chain against it).
#: A node's lookup, load and save of a step (``request_finished`` and the
#: per-layer hooks need not touch the store, so they end no outage). Each is a hook
#: whose ``Unavailable`` is an outage, not a fault.
STORE_CALLS = frozenset(hooks_where(store_call=True))
assert all(HOOKS[n].away != Away.FAULT for n in STORE_CALLS)


def markdown_table() -> str:
    """``docs/hooks.md``'s hook table (``tests/test_hookspecs.py`` checks it is current)."""
    rows = [
        "| hook | process | called | combine | on `recompute` | store away | nodes | `vllm` node "
        "| what |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for h in HOOKS.values():
        doc = (getattr(NodeSpec, h.name).__doc__ or "").strip().splitlines()[0]
        rows.append(
            f"| `{h.signature}` | {h.process} | {h.every} | {h.combine} | {h.recompute} "
            f"| {h.away}{'; a return ends the outage' if h.store_call else ''} | {h.nodes} "
            f"| {h.native}{' (and `**kwargs`)' if h.passes_kwargs else ''} "
            f"| {doc.replace('|', '/')} |"
        )
    return "\n".join(rows) + "\n"
