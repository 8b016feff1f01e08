"""The chain: node instances of one vLLM role, dispatched with MultiConnector semantics.

pluggy is the registry, the validator (``check_pending``) and the tracer; the
calls themselves go through lists bound once from pluggy's own hookimpls, in
pipeline order, so a node that does not implement a hook costs nothing and a
per-layer hook is a plain loop (see DESIGN.md, "Hot paths").

Nothing here imports torch or vLLM: vLLM's objects pass through untouched, and
the vLLM adapter (:mod:`composer.vllm.connector`) wraps results in vLLM's types.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy
import structlog

from composer.faults import LOAD_HOOKS, RECOVERABLE_HOOKS, NodeFailed, WorkerLedger
from composer.hookspecs import PER_LAYER_HOOKS, PROJECT, NodeSpec
from composer.pipeline import ResolvedNode, ResolvedPipeline
from composer.plugin import NodeContext
from composer.stats import Changes, NodeStats
from composer.views import RequestView, StepView

log = structlog.get_logger("kv_composer")

VllmRole = Literal["scheduler", "worker"]
Call = Callable[..., Any]

SAVE_HOOKS = frozenset({"save_kv_layer", "wait_for_save"})
#: Hooks vLLM calls every engine step: timed in per-node stats (``hook_seconds``)
#: only with the pipeline's ``time_step_hooks``, like per-layer hooks with
#: ``time_layer_hooks``; per-request and one-time hooks are always timed.
STEP_HOOKS = frozenset(
    {
        "build_connector_meta",
        "has_pending_block_frees",
        "has_pending_push_work",
        "start_load_kv",
        "wait_for_save",
        "finish_forward",
        "clear_connector_metadata",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
        "get_kv_connector_stats",
        "get_kv_connector_kv_cache_events",
    }
)


class TransferParamsClash(RuntimeError):
    pass


@dataclass
class ChainMetadata:
    """What the scheduler half sends the worker half each step."""

    per_node: dict[str, Any] = field(default_factory=dict)
    #: Finished request id -> the nodes holding its blocks for a save; vLLM frees
    #: them when the last one has finished (MultiConnector's rule).
    holds: dict[str, tuple[str, ...]] | None = None
    #: Node id -> block ids it loads this step, so a failing load becomes load errors.
    loads: dict[str, set[int]] = field(default_factory=dict)
    #: Request id -> the node that starts loading it asynchronously this step.
    async_loads: dict[str, str] | None = None
    #: Nodes switched off in the scheduler: the worker halves follow.
    disabled: frozenset[str] = frozenset()


@dataclass
class ChainWorkerMetadata:
    """What the worker halves send back; one entry per node that returned something."""

    per_node: dict[str, Any] = field(default_factory=dict)
    #: Nodes switched off in a worker: the scheduler half follows.
    disabled: frozenset[str] = frozenset()

    def aggregate(self, other: ChainWorkerMetadata) -> ChainWorkerMetadata:
        merged = dict(self.per_node)
        for node_id, meta in other.per_node.items():
            mine = merged.get(node_id)
            merged[node_id] = meta if mine is None else mine.aggregate(meta)
        return type(self)(merged, self.disabled | other.disabled)


@dataclass
class TransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


def _positional(impl: pluggy.HookImpl, spec_args: tuple[str, ...]) -> Call:
    """A callable taking the spec's arguments positionally, for an impl that may take fewer."""
    return _adapt(impl.function, tuple(impl.argnames), spec_args)


def _adapt(fn: Call, argnames: tuple[str, ...], spec_args: tuple[str, ...]) -> Call:
    """``fn`` takes ``argnames`` (some of ``spec_args``, in spec order): make it take them all."""
    if argnames == spec_args:
        return fn
    index = [spec_args.index(a) for a in argnames]
    # The usual shapes get a wrapper that builds no list per call.
    if not index:
        return lambda *args: fn()
    if len(index) == 1:
        (i,) = index
        return lambda *args: fn(args[i])
    if len(index) == 2:
        i, j = index
        return lambda *args: fn(args[i], args[j])
    return lambda *args: fn(*[args[i] for i in index])


class Chain:
    """The nodes of one pipeline in one vLLM process.

    Per-layer and per-step hooks are attributes bound by ``_bind`` to the
    current call lists (re-bound when a node is switched off).
    """

    wait_for_layer_load: Callable[[str], None]
    save_kv_layer: Callable[[str, Any, Any], None]
    handle_preemptions: Callable[[ChainMetadata], None]
    bind_connector_metadata: Callable[[ChainMetadata], None]
    start_load_kv: Callable[..., None]
    wait_for_save: Callable[[], None]
    finish_forward: Callable[[], None]
    clear_connector_metadata: Callable[[], None]
    get_transfer_results: Callable[[set[str]], Any]
    get_block_ids_with_load_errors: Callable[[], set[int]]
    build_connector_worker_meta: Callable[[], ChainWorkerMetadata | None]
    get_kv_connector_kv_cache_events: Callable[[], Any]
    take_stats: Callable[[], dict[str, dict[str, Any]]]
    get_kv_connector_stats: Callable[[], Any]
    build_connector_meta: Callable[[Any], ChainMetadata]
    update_connector_output: Callable[[Any], None]
    take_events: Callable[[], Iterable[Any]]
    has_pending_block_frees: Callable[[], bool]
    has_pending_push_work: Callable[[], bool]

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        vllm_role: VllmRole,
        *,
        vllm_config: Any = None,
        kv_cache_config: Any = None,
        trace: bool = False,
        metadata_type: type[ChainMetadata] = ChainMetadata,
        worker_metadata_type: type[ChainWorkerMetadata] = ChainWorkerMetadata,
        transfer_results_type: Callable[[], Any] = TransferResults,
        stats_type: Callable[..., Any] | None = None,
        restore_worker_meta: bool = False,
    ) -> None:
        """``*_type``: the classes the chain builds its results with (the vLLM
        adapter passes subclasses of vLLM's own types, so results need no copy);
        ``stats_type(data=...)`` wraps what ``get_kv_connector_stats`` returns.
        ``restore_worker_meta``: during ``update_connector_output`` each node finds
        its own worker metadata in the output's ``kv_connector_worker_meta`` (as
        MultiConnector's children do), and the chain's is put back after."""
        self.pipeline = pipeline
        self._metadata_type = metadata_type
        self._worker_metadata_type = worker_metadata_type
        self._transfer_results_type = transfer_results_type
        self._stats_type = stats_type
        self._restore_worker_meta = restore_worker_meta
        self.vllm_role = vllm_role
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(NodeSpec)
        self.nodes: dict[str, Any] = {}
        self.stats: dict[str, NodeStats] = {}
        #: Marked by any write to any node's counters; cleared by each report.
        self._stats_changes = Changes()
        self.policy: dict[str, str] = {}
        self._plugin_names: dict[str, str] = {}
        self.log = log.bind(role=vllm_role)
        services: dict[str, Any] = {}
        for rnode in pipeline.nodes:
            if vllm_role not in rnode.plugin.vllm_roles:
                continue
            ctx = NodeContext(
                node_id=rnode.id,
                config=rnode.config,
                role=rnode.role,
                vllm_role=vllm_role,
                needs={d: services[d] for d in rnode.needs if d in services},
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                stats=NodeStats(changes=self._stats_changes),
            )
            instance = rnode.plugin.node_class()(ctx)
            self.pm.register(instance, name=rnode.id)
            self.nodes[rnode.id] = instance
            self.stats[rnode.id] = ctx.stats
            self.policy[rnode.id] = rnode.on_error
            self._plugin_names[rnode.id] = rnode.plugin.name
            services[rnode.id] = instance.service()
            self.log.debug("node created", node=rnode.id, plugin=rnode.plugin.name)
        # A misspelled @hookimpl is an error, not a silently skipped node.
        self.pm.check_pending()
        if trace:
            self.pm.trace.root.setwriter(lambda msg: self.log.debug("hook", trace=msg.rstrip()))
            self.pm.enable_tracing()
        self.disabled: set[str] = set()
        self.load_error_blocks: set[int] = set()
        #: Request -> (node serving it, num_computed_tokens at lookup, async load).
        self._chosen: dict[str, tuple[str, int, bool]] = {}
        self._served: dict[str, tuple[str, int]] = {}
        self._pending_loads: dict[str, set[int]] = {}
        self._step_loads: dict[str, set[int]] = {}
        # Scheduler side, sent with the next step's metadata.
        self._new_holds: dict[str, tuple[str, ...]] = {}
        self._new_async_loads: dict[str, str] = {}
        # Worker side.
        self.ledger = WorkerLedger()
        #: Requests released or failed by the chain itself (a node switched off).
        self._released: set[str] = set()
        self._failed_recving: set[str] = set()
        #: Switched off here, not yet told to the scheduler.
        self._unreported_disabled: set[str] = set()
        self._block_size = _block_size(kv_cache_config)
        #: Called after the call lists change (a node switched off).
        self.on_rebind: list[Callable[[], None]] = []
        self._bind()

    # ------------------------------------------------------------------ #
    # binding
    # ------------------------------------------------------------------ #

    def _order_for(self, hook: str) -> list[str]:
        order = [n.id for n in self.pipeline.nodes]
        if hook == "get_num_new_matched_tokens":
            order = list(self.pipeline.load_order)
        elif hook in LOAD_HOOKS:
            order = [n for n in order if n in self.pipeline.load_order]
        elif hook in SAVE_HOOKS:
            order = [n for n in order if n in self.pipeline.save_to]
        return [n for n in order if n in self.nodes and n not in self.disabled]

    def _bind(self) -> None:
        """(Re)build every hook's call list: (node id, callable) in dispatch order."""
        self.calls: dict[str, list[tuple[str, Call]]] = {}
        #: Hook -> the spec arguments some implementing node names (others may be None).
        self._wanted: dict[str, set[str]] = {}
        #: Hook -> the spec's argument names.
        self._spec_args: dict[str, tuple[str, ...]] = {}
        #: Hook -> (node id, callable taking the arguments its hookimpl names, those names).
        self._own_calls: dict[str, list[tuple[str, Call, tuple[str, ...]]]] = {}
        # A node's direct_hooks(): callables bound straight into the call lists
        # (taking what the node's hookimpl takes), or None for a hook the node
        # implements but that would do nothing.
        directs: dict[str, dict[str, Call | None]] = {}
        for node_id, node in self.nodes.items():
            direct = getattr(node, "direct_hooks", None)
            directs[node_id] = direct() if direct is not None else {}
        for name in dir(NodeSpec):
            caller = getattr(self.pm.hook, name, None)
            if caller is None or not hasattr(caller, "get_hookimpls"):
                continue
            spec_args = tuple(caller.spec.argnames)
            self._spec_args[name] = spec_args
            impls = {impl.plugin_name: impl for impl in caller.get_hookimpls()}
            bound: list[tuple[str, Call]] = []
            own: list[tuple[str, Call, tuple[str, ...]]] = []
            wanted: set[str] = set()
            for node_id in self._order_for(name):
                if node_id not in impls:
                    continue
                direct = directs[node_id]
                fast = direct.get(name)
                if fast is None and name in direct:
                    continue
                argnames = tuple(impls[node_id].argnames)
                fn = fast if fast is not None else impls[node_id].function
                if name in STEP_HOOKS and self.pipeline.time_step_hooks:
                    fn = _timed(fn, self.stats[node_id], name)
                own.append((node_id, fn, argnames))
                bound.append((node_id, _adapt(fn, argnames, spec_args)))
                wanted.update(argnames)
            self.calls[name] = bound
            self._own_calls[name] = own
            self._wanted[name] = wanted
        self._bind_hot_paths()
        self._bind_step_paths()
        for callback in getattr(self, "on_rebind", ()):
            callback()

    def _bind_hot_paths(self) -> None:
        # Per-layer hooks are instance attributes specialised for their call list,
        # so vLLM's per-layer call costs one Python call per implementing node.
        for hook in PER_LAYER_HOOKS:
            calls = self.calls[hook]
            timed = self.pipeline.time_layer_hooks
            setattr(self, hook, self._make_layer_dispatch(hook, calls, timed))

    def _make_layer_dispatch(self, hook: str, calls: list[tuple[str, Call]], timed: bool) -> Call:
        fault = self._fault
        if not calls:
            return _noop
        if timed:
            stats = self.stats
            clock = time.perf_counter

            def dispatch_timed(*args: Any) -> None:
                for node_id, fn in calls:
                    t0 = clock()
                    try:
                        fn(*args)
                    except Exception as exc:
                        fault(node_id, hook, exc)
                    stats[node_id].add_time(hook, clock() - t0)

            return dispatch_timed
        fixed = _fixed_arity_dispatch(hook, calls, fault, len(self._spec_args[hook]))
        if fixed is not None:
            return fixed
        if len(calls) == 1:
            ((node_id, fn),) = calls

            def dispatch_one(*args: Any) -> None:
                try:
                    fn(*args)
                except Exception as exc:
                    fault(node_id, hook, exc)

            return dispatch_one

        def dispatch(*args: Any) -> None:
            for node_id, fn in calls:
                try:
                    fn(*args)
                except Exception as exc:
                    fault(node_id, hook, exc)

        return dispatch

    def _bind_step_paths(self) -> None:
        # Per-step hooks, like per-layer ones, are bound to their call lists: no
        # per-call dicts, views or lists that no node needs. (With time_step_hooks
        # the callables in those lists time themselves; see _bind.)
        calls = self.calls
        fault = self._fault
        disabled = tuple(self.disabled)
        off = frozenset(self.disabled)
        ledger = self.ledger

        def handle_preemptions(metadata: ChainMetadata) -> None:
            per_node = metadata.per_node
            for node_id, fn in preempt_calls:
                try:
                    fn(per_node.get(node_id))
                except Exception as exc:
                    fault(node_id, "handle_preemptions", exc)

        preempt_calls = calls["handle_preemptions"]
        self.handle_preemptions = handle_preemptions

        def bind_connector_metadata(metadata: ChainMetadata) -> None:
            if metadata.disabled and not metadata.disabled <= off:
                for node_id in sorted(metadata.disabled - off):
                    self._switch_off(node_id, "switched off in the scheduler")
                return self.bind_connector_metadata(metadata)  # re-bound without them
            if metadata.holds:
                for req_id, holders in metadata.holds.items():
                    live = [n for n in holders if n not in off]
                    if live:
                        ledger.hold(req_id, live)
                    else:
                        self._released.add(req_id)
            if metadata.async_loads:
                for req_id, node_id in metadata.async_loads.items():
                    if node_id in off:
                        self._failed_recving.add(req_id)
                    else:
                        ledger.loading(node_id, req_id)
            loads = self._step_loads = metadata.loads
            for node_id in disabled:
                # A switched-off node loads nothing: vLLM recomputes what it was to load.
                self.load_error_blocks |= loads.get(node_id, set())
            per_node = metadata.per_node
            for node_id, fn in bind_calls:
                try:
                    fn(per_node.get(node_id))
                except Exception as exc:
                    fault(node_id, "bind_connector_metadata", exc)

        bind_calls = calls["bind_connector_metadata"]
        self.bind_connector_metadata = bind_connector_metadata
        self.get_transfer_results = self._make_transfer_results()
        self.update_connector_output = self._make_update_connector_output()
        self.take_events = self._make_take_events()

        self.start_load_kv = self._make_start_load_kv()
        self.wait_for_save = self._make_layer_dispatch(
            "wait_for_save", calls["wait_for_save"], False
        )
        self.finish_forward = self._make_layer_dispatch(
            "finish_forward", calls["finish_forward"], False
        )
        for hook in ("has_pending_block_frees", "has_pending_push_work"):
            setattr(self, hook, self._make_any_true(hook))

        def clear_connector_metadata() -> None:
            self._step_loads = {}
            for node_id, fn in clear_calls:
                try:
                    fn()
                except Exception as exc:
                    fault(node_id, "clear_connector_metadata", exc)

        clear_calls = calls["clear_connector_metadata"]
        self.clear_connector_metadata = clear_connector_metadata

        def get_block_ids_with_load_errors() -> set[int]:
            blocks, self.load_error_blocks = self.load_error_blocks, set()
            for node_id, fn in error_calls:
                try:
                    failed = fn()
                except Exception as exc:
                    fault(node_id, "get_block_ids_with_load_errors", exc)
                    continue
                if failed:
                    blocks |= failed
            return blocks

        error_calls = calls["get_block_ids_with_load_errors"]
        self.get_block_ids_with_load_errors = get_block_ids_with_load_errors

        worker_meta_type = self._worker_metadata_type

        def build_connector_worker_meta() -> ChainWorkerMetadata | None:
            per_node = {}
            for node_id, fn in worker_meta_calls:
                try:
                    meta = fn()
                except Exception as exc:
                    fault(node_id, "build_connector_worker_meta", exc)
                    continue
                if meta is not None:
                    per_node[node_id] = meta
            if self._unreported_disabled:
                # The scheduler half of a node switched off here must stop too.
                off, self._unreported_disabled = frozenset(self._unreported_disabled), set()
                return worker_meta_type(per_node, off)
            return worker_meta_type(per_node) if per_node else None

        worker_meta_calls = calls["build_connector_worker_meta"]
        self.build_connector_worker_meta = (
            build_connector_worker_meta
            if worker_meta_calls or self._unreported_disabled
            else _none
        )

        def get_kv_connector_kv_cache_events() -> Any:
            merged = None
            for node_id, fn in event_calls:
                try:
                    events = fn()
                except Exception as exc:
                    fault(node_id, "get_kv_connector_kv_cache_events", exc)
                    continue
                if events is None:
                    continue
                merged = events if merged is None else merged.merge(events)
            return merged

        event_calls = calls["get_kv_connector_kv_cache_events"]
        self.get_kv_connector_kv_cache_events = (
            get_kv_connector_kv_cache_events if event_calls else _none
        )
        self.take_stats = self._make_take_stats()
        self.get_kv_connector_stats = self._make_take_stats(self._stats_type or _data_or_none)
        self.build_connector_meta = self._make_build_connector_meta()

    def _make_any_true(self, hook: str) -> Call:
        calls = self.calls[hook]
        if not calls:
            return _false
        fault = self._fault

        def any_true() -> bool:
            found = False  # every node is asked, as with any_true()
            for node_id, fn in calls:
                try:
                    if fn():
                        found = True
                except Exception as exc:
                    fault(node_id, hook, exc)
            return found

        return any_true

    def _make_start_load_kv(self) -> Call:
        # vLLM passes keyword arguments (0.32.0: none yet; later versions do) that a
        # native connector takes as **kwargs: they reach every callable that takes them.
        calls = [(n, fn, _takes_kwargs(fn)) for n, fn in self.calls["start_load_kv"]]
        fault = self._fault

        def start_load_kv(forward_context: Any, **kwargs: Any) -> None:
            for node_id, fn, takes_kwargs in calls:
                try:
                    if kwargs and takes_kwargs:
                        fn(forward_context, **kwargs)
                    else:
                        fn(forward_context)
                except Exception as exc:
                    fault(node_id, "start_load_kv", exc)

        return start_load_kv

    def _make_transfer_results(self) -> Call:
        direct = dict(self.calls["get_transfer_results"])
        via_finished = dict(self.calls["get_finished"])
        # (node id, callable, returns TransferResults?) in node order.
        entries = [
            (n, direct[n], True) if n in direct else (n, via_finished[n], False)
            for n in self.nodes
            if n not in self.disabled and (n in direct or n in via_finished)
        ]
        results_type = self._transfer_results_type
        fault = self._fault
        ledger = self.ledger

        def get_transfer_results(finished_req_ids: set[str]) -> Any:
            results = results_type()
            if self._released:
                # Held only by nodes that were switched off.
                results.finished_sending.update(self._released)
                self._released = set()
            if self._failed_recving:
                # Loading through a node that was switched off: vLLM recomputes them.
                results.finished_recving.update(self._failed_recving)
                results.failed_recving.update(self._failed_recving)
                self._failed_recving = set()
            for node_id, fn, is_direct in entries:
                try:
                    if is_direct:
                        r = fn(finished_req_ids)
                        sending, recving = r.finished_sending, r.finished_recving
                        if r.failed_recving:
                            results.failed_recving.update(r.failed_recving)
                    else:
                        sending, recving = fn(finished_req_ids)
                except Exception as exc:
                    hook = "get_transfer_results" if is_direct else "get_finished"
                    fault(node_id, hook, exc)
                    continue
                if recving:
                    ledger.received(node_id, recving)
                    results.finished_recving.update(recving)
                if sending:
                    results.finished_sending.update(ledger.sent(node_id, sending))
            return results

        return get_transfer_results

    def _make_update_connector_output(self) -> Call:
        # Each node gets the arguments its hookimpl names (a native node just
        # vLLM's output), without a wrapper per node.
        calls = [
            (node_id, fn, "connector_output" in names, "worker_meta" in names)
            for node_id, fn, names in self._own_calls["update_connector_output"]
        ]
        fault = self._fault
        swap = self._restore_worker_meta
        off = frozenset(self.disabled)

        def follow_workers(connector_output: Any) -> bool:
            """Switch off here what a worker switched off; True if anything was."""
            chain_meta = getattr(connector_output, "kv_connector_worker_meta", None)
            gone = getattr(chain_meta, "disabled", None)
            if not gone or gone <= off:
                return False
            for node_id in sorted(gone - off):
                self._switch_off(node_id, "switched off in a worker")
            return True

        if not calls:
            # (With nothing called, nothing is overwritten either.)
            return follow_workers
        if swap and all(out and not meta for _, _, out, meta in calls):
            # Only native nodes (the usual case for vLLM's own connectors): the
            # loop MultiConnector runs, with no per-node argument choice.
            native_calls = [(node_id, fn) for node_id, fn, _, _ in calls]

            def update_native_only(connector_output: Any) -> None:
                chain_meta = connector_output.kv_connector_worker_meta
                # (Inline: a call per step costs more than this check.)
                if (
                    chain_meta is not None
                    and chain_meta.disabled
                    and follow_workers(connector_output)
                ):
                    return self.update_connector_output(connector_output)  # re-bound
                per_node = getattr(chain_meta, "per_node", None)
                try:
                    for node_id, fn in native_calls:
                        connector_output.kv_connector_worker_meta = (
                            per_node.get(node_id) if per_node else None
                        )
                        try:
                            fn(connector_output)
                        except Exception as exc:
                            fault(node_id, "update_connector_output", exc)
                finally:
                    connector_output.kv_connector_worker_meta = chain_meta

            return update_native_only

        def update_connector_output(connector_output: Any) -> None:
            if follow_workers(connector_output):
                return self.update_connector_output(connector_output)  # re-bound
            chain_meta = getattr(connector_output, "kv_connector_worker_meta", None)
            per_node = chain_meta.per_node if isinstance(chain_meta, ChainWorkerMetadata) else {}
            try:
                for node_id, fn, takes_output, takes_meta in calls:
                    meta = per_node.get(node_id)
                    if swap:
                        connector_output.kv_connector_worker_meta = meta
                    try:
                        if takes_output and takes_meta:
                            fn(connector_output, meta)
                        elif takes_output:
                            fn(connector_output)
                        elif takes_meta:
                            fn(meta)
                        else:
                            fn()
                    except Exception as exc:
                        fault(node_id, "update_connector_output", exc)
            finally:
                if swap:
                    connector_output.kv_connector_worker_meta = chain_meta

        return update_connector_output

    def _make_take_events(self) -> Call:
        calls = self.calls["take_events"]
        if not calls:
            return _no_events
        fault = self._fault

        def take_events() -> Iterable[Any]:
            for node_id, fn in calls:
                try:
                    for event in fn():
                        # vLLM's stored/removed events name the offloading tier
                        # that made them in ``ownership``: the node, unless set.
                        if getattr(event, "ownership", "") is None:
                            event.ownership = node_id
                        yield event
                except Exception as exc:
                    fault(node_id, "take_events", exc)

        return take_events

    def _make_take_stats(self, wrap: Callable[..., Any] | None = None) -> Call:
        """``take_stats``; with ``wrap``, ``get_kv_connector_stats`` (wrap(data=...) or None)."""
        calls = self.calls["get_kv_connector_stats"]
        fault = self._fault
        plugins = {n.id: n.plugin.name for n in self.pipeline.nodes}
        entries = [(node_id, stats, plugins[node_id]) for node_id, stats in self.stats.items()]
        changes = self._stats_changes
        nothing: dict[str, Any] | None = None if wrap is not None else {}

        def take_stats() -> Any:
            own: dict[str, Any] | None = None
            for node_id, fn in calls:
                try:
                    node_stats = fn()
                except Exception as exc:
                    fault(node_id, "get_kv_connector_stats", exc)
                    continue
                if node_stats is not None:
                    if own is None:
                        own = {}
                    own[node_id] = node_stats
            if own is None and not changes.seen:
                return nothing  # the usual step: no node counted anything
            # Cleared before reading, so a count made meanwhile (a node's own
            # thread) marks it again for the next report instead of being lost.
            changes.seen = False
            out: dict[str, dict[str, Any]] = {}
            for node_id, stats, plugin in entries:
                node_stats = own.get(node_id) if own else None
                if node_stats is None and stats.is_empty():
                    continue
                entry: dict[str, Any] = {"plugin": plugin, "counters": stats.take()}
                if node_stats is not None:
                    entry["node"] = node_stats
                out[node_id] = entry
            if wrap is None:
                return out
            return wrap(data=out) if out else None

        return take_stats

    def _make_build_connector_meta(self) -> Call:
        metadata_type = self._metadata_type
        fault = self._fault
        if "step" in self._wanted["build_connector_meta"]:
            # Some node names the step view: every node gets the spec's arguments.
            calls = [(node_id, fn, True) for node_id, fn in self.calls["build_connector_meta"]]
        else:
            # No node names it: none is built, and each node gets what its hookimpl
            # names (the scheduler output, or nothing).
            calls = [
                (node_id, fn if argnames else _drop_args(fn), False)
                for node_id, fn, argnames in self._own_calls["build_connector_meta"]
            ]
        wants_step = bool(calls) and calls[0][2]

        def build_connector_meta(scheduler_output: Any) -> ChainMetadata:
            per_node = {}
            if wants_step:
                step = StepView(scheduler_output)
                for node_id, fn, _ in calls:
                    try:
                        per_node[node_id] = fn(step, scheduler_output)
                    except Exception as exc:
                        fault(node_id, "build_connector_meta", exc)
                        per_node[node_id] = None
            else:
                for node_id, fn, _ in calls:
                    try:
                        per_node[node_id] = fn(scheduler_output)
                    except Exception as exc:
                        fault(node_id, "build_connector_meta", exc)
                        per_node[node_id] = None
            meta = metadata_type(per_node=per_node, loads=self._pending_loads)
            self._pending_loads = {}
            if self._new_holds:
                meta.holds, self._new_holds = self._new_holds, {}
            if self._new_async_loads:
                meta.async_loads, self._new_async_loads = self._new_async_loads, {}
            if self.disabled:
                meta.disabled = frozenset(self.disabled)
            return meta

        return build_connector_meta

    def implemented(self, hook: str) -> list[str]:
        return [n for n, _ in self.calls.get(hook, ())]

    # ------------------------------------------------------------------ #
    # faults
    # ------------------------------------------------------------------ #

    def _fault(self, node_id: str, hook: str, exc: BaseException) -> None:
        """Apply the node's error policy (see :mod:`composer.faults`); returns only if
        the engine goes on, with nothing the node failed to load served."""
        policy = self.policy.get(node_id, "fail")
        stats = self.stats[node_id]
        stats.errors += 1
        stats.extra.add(f"errors_{hook}")
        where = {"node": node_id, "hook": hook, "error": repr(exc)}
        if policy == "fail":
            if hook in LOAD_HOOKS:
                self.load_error_blocks |= self._step_loads.get(node_id, set())
            self.log.error("node failed; on_error: fail stops the engine", **where)
            raise NodeFailed(node_id, self._plugin_names.get(node_id, "?"), hook, exc) from exc
        if policy == "recompute" and hook in RECOVERABLE_HOOKS:
            if hook not in LOAD_HOOKS:
                self.log.warning("node failed; only this call's result is lost", **where)
                return
            if not self.ledger.has_async_loads(node_id):
                blocks = self._step_loads.get(node_id, set())
                self.load_error_blocks |= blocks
                stats.extra.add("blocks_recomputed", len(blocks))
                self.log.warning(
                    "node failed while loading; vLLM recomputes the blocks it was loading",
                    blocks=len(blocks),
                    **where,
                )
                return
        if node_id in self.disabled:
            return
        if policy == "disable":
            reason = "on_error: disable"
        else:
            reason = (
                f"on_error: recompute cannot repair a fault in {hook} (the node's scheduler "
                "and worker halves may be out of step, or a transfer still in flight), so "
                "the node is switched off instead"
            )
        self._switch_off(node_id, reason, **where)

    def _switch_off(self, node_id: str, reason: str, **where: Any) -> None:
        """Take the node out of this process's chain for good, releasing what it held."""
        if node_id in self.disabled:
            return
        self.disabled.add(node_id)
        stats = self.stats[node_id]
        stats.disabled = True
        released = failed = blocks = 0
        if self.vllm_role == "worker":
            self._unreported_disabled.add(node_id)
            step = self._step_loads.get(node_id, set())
            blocks = len(step - self.load_error_blocks)
            self.load_error_blocks |= step
            done = self.ledger.release(node_id)
            loading = self.ledger.drop_loads(node_id)
            self._released |= done
            self._failed_recving |= loading
            released, failed = len(done), len(loading)
        if blocks:
            stats.extra.add("blocks_recomputed", blocks)
        # Its shutdown stops its transfers: nothing of it writes into vLLM's blocks
        # once the requests it was loading or holding are handed back.
        for name, fn in self.calls.get("shutdown", ()):
            if name == node_id:
                try:
                    fn()
                except Exception as exc:
                    self.log.error(
                        "switched-off node's shutdown failed", node=node_id, error=repr(exc)
                    )
        self.log.warning(
            "node switched off",
            reason=reason,
            blocks_recomputed=blocks,
            requests_recomputed=failed,
            holds_released=released,
            **{"node": node_id, **where},
        )
        self._bind()

    def _each(self, hook: str, *args: Any, default: Any = None) -> list[tuple[str, Any]]:
        """Call every node implementing ``hook``, timing it; a failed node yields ``default``.

        For one-time and per-request hooks; per-step and per-layer hooks have
        dispatch bound in _bind_step_paths / _bind_hot_paths.
        """
        out = []
        clock = time.perf_counter
        for node_id, fn in self.calls[hook]:
            t0 = clock()
            try:
                result = fn(*args)
            except Exception as exc:
                self._fault(node_id, hook, exc)
                result = default
            self.stats[node_id].add_time(hook, clock() - t0)
            out.append((node_id, result))
        return out

    # ------------------------------------------------------------------ #
    # worker: initialize
    # ------------------------------------------------------------------ #

    def initialize_worker_connector(
        self, model: Any, vllm_config: Any, kv_cache_config: Any
    ) -> None:
        self._each("initialize_worker_connector", model, vllm_config, kv_cache_config)

    def get_mem_pool_context(self) -> Any:
        found = [(n, ctx) for n, ctx in self._each("get_mem_pool_context") if ctx is not None]
        if len(found) > 1:
            raise ValueError(
                f"nodes {[n for n, _ in found]} all provide a KV cache memory pool; "
                "KV cache is allocated once, in one pool: keep at most one"
            )
        return found[0][1] if found else None

    def register_kv_caches(self, canonical: Any, raw: dict[str, Any]) -> None:
        self._each("register_kv_caches", canonical, raw)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._each("set_host_xfer_buffer_ops", copy_operation)

    def get_handshake_metadata(self) -> Any:
        for _, meta in self._each("get_handshake_metadata"):
            if meta is not None:
                return meta
        return None

    # ------------------------------------------------------------------ #
    # scheduler
    # ------------------------------------------------------------------ #

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._each("bind_kv_cache_manager", kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._each("bind_gpu_block_pool", gpu_block_pool)

    def on_new_request(self, request: Any) -> None:
        self._each("on_new_request", RequestView(request))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        view = RequestView(request)
        longest = self.pipeline.load_policy == "longest_hit"
        chosen: tuple[str, int, bool] | None = None
        for node_id, fn in self.calls["get_num_new_matched_tokens"]:
            stats = self.stats[node_id]
            stats.lookups += 1
            t0 = time.perf_counter()
            try:
                tokens, load_async = fn(view, num_computed_tokens)
            except Exception as exc:
                self._fault(node_id, "get_num_new_matched_tokens", exc)
                tokens, load_async = 0, False
            stats.add_time("get_num_new_matched_tokens", time.perf_counter() - t0)
            if tokens is None:
                # Still looking up: vLLM asks again later (MultiConnector's rule).
                return None, False
            if tokens > 0:
                stats.hits += 1
                if chosen is None or (longest and tokens > chosen[1]):
                    chosen = (node_id, tokens, load_async)
        if chosen is None:
            self._chosen.pop(view.request_id, None)
            return 0, False
        self._chosen[view.request_id] = (chosen[0], num_computed_tokens, chosen[2])
        return chosen[1], chosen[2]

    def chosen_node(self, request_id: str) -> str | None:
        entry = self._chosen.get(request_id)
        return entry[0] if entry else None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        view = RequestView(request)
        entry = self._chosen.get(view.request_id)
        chosen = entry[0] if entry else None
        block_ids = blocks.get_block_ids() if blocks is not None else ()
        if chosen is not None and num_external_tokens > 0:
            self.stats[chosen].tokens_hit += num_external_tokens
            self._served[view.request_id] = (chosen, num_external_tokens)
            first = entry[1] // self._block_size if entry and self._block_size else 0
            last = (
                -(-(entry[1] + num_external_tokens) // self._block_size)
                if entry and self._block_size
                else None
            )
            loading = self._pending_loads.setdefault(chosen, set())
            for group in block_ids:
                loading.update(group[first:last])
            if entry and entry[2]:
                # Async: the worker tracks it, so that a node switched off before
                # it finishes loading reports it failed instead of leaving it waiting.
                self._new_async_loads[view.request_id] = chosen
        for node_id, fn in self.calls["update_state_after_alloc"]:
            tokens = num_external_tokens if node_id == chosen else 0
            try:
                fn(view, block_ids, tokens, blocks)
            except Exception as exc:
                self._fault(node_id, "update_state_after_alloc", exc)

    def ask_chosen(self, hook: str, request: Any, *args: Any) -> Any:
        """Ask only the node serving ``request``; None when it has no answer."""
        chosen = self.chosen_node(request.request_id)
        for node_id, fn in self.calls[hook]:
            if node_id == chosen:
                try:
                    return fn(RequestView(request), *args)
                except Exception as exc:
                    self._fault(node_id, hook, exc)
        return None

    def _finish(
        self, request: Any, results: Iterable[tuple[str, Any]]
    ) -> tuple[bool, dict[str, Any] | None]:
        holders: list[str] = []
        params: dict[str, Any] | None = None
        writer: dict[str, str] = {}
        for node_id, result in results:
            if result is _FAULTED:
                # It may still be saving from these blocks: they stay held until
                # its worker half is switched off (the fault switched it off).
                holders.append(node_id)
                continue
            hold, node_params = result if result is not None else (False, None)
            if hold:
                holders.append(node_id)
            if node_params is None:
                continue
            clash = sorted(set(writer) & set(node_params))
            if clash:
                raise TransferParamsClash(
                    f"kv_transfer_params key(s) {clash} written by node "
                    f'"{writer[clash[0]]}" and node "{node_id}"'
                )
            writer.update(dict.fromkeys(node_params, node_id))
            params = {**(params or {}), **node_params}
        if holders:
            self._new_holds[request.request_id] = tuple(holders)
        served = self._served.pop(request.request_id, None)
        if self.pipeline.annotate_outputs:
            params = {
                **(params or {}),
                "kv_composer": {
                    "served_by": served[0] if served else None,
                    "tokens": served[1] if served else 0,
                },
            }
        self._chosen.pop(request.request_id, None)
        return bool(holders), params

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        view = RequestView(request)
        results = self._each("request_finished", view, block_ids, default=_FAULTED)
        return self._finish(request, results)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not self.pipeline.hma:
            assert len(block_ids) == 1, (
                "HMA with several KV cache groups needs every node to support it"
            )
            return self.request_finished(request, block_ids[0])
        view = RequestView(request)
        all_groups = dict(self.calls["request_finished_all_groups"])
        results: list[tuple[str, Any]] = []
        for node_id in self.nodes:
            if node_id in self.disabled:
                continue
            fn = all_groups.get(node_id)
            if fn is None:
                continue
            try:
                results.append((node_id, fn(view, self._groups_for(node_id, block_ids))))
            except Exception as exc:
                self._fault(node_id, "request_finished_all_groups", exc)
                results.append((node_id, _FAULTED))
        return self._finish(request, results)

    def _groups_for(self, node_id: str, block_ids: tuple[list[int], ...]) -> tuple[list[int], ...]:
        rnode: ResolvedNode = self.pipeline.node(node_id)
        group = getattr(rnode.config, "kv_cache_group", None)
        if rnode.capabilities.kv_cache_groups == "one" and isinstance(group, int):
            return (block_ids[group],)
        return block_ids

    def register_finished_partial_tail(self, request: Any, block_ids: Any, offloads: Any) -> bool:
        view = RequestView(request)
        results = self._each(
            "register_finished_partial_tail", view, block_ids, offloads, default=False
        )
        return any(r for _, r in results)

    def get_finished_count(self) -> int | None:
        counts = [c for _, c in self._each("get_finished_count")]
        if not counts or any(c is None for c in counts):
            return None
        if len(set(counts)) > 1:
            raise ValueError(f"nodes returned incompatible finished counts: {sorted(set(counts))}")
        return counts[0]

    def broadcast(self, hook: str, *args: Any) -> None:
        self._each(hook, *args)

    def reset_cache(self) -> bool:
        return all(r is not False for _, r in self._each("reset_cache"))

    # ------------------------------------------------------------------ #
    # shutdown
    # ------------------------------------------------------------------ #

    def shutdown(self) -> None:
        """Every node's shutdown runs; a failure is raised (after the others) only
        for a node whose policy is ``fail``."""
        error: BaseException | None = None
        for node_id, fn in self.calls["shutdown"]:
            try:
                fn()
            except Exception as exc:
                self.stats[node_id].errors += 1
                self.stats[node_id].extra.add("errors_shutdown")
                self.log.error(
                    "node shutdown failed", node=node_id, hook="shutdown", error=repr(exc)
                )
                if self.policy.get(node_id, "fail") == "fail":
                    error = exc
        if error is not None:
            raise error


#: What a request_finished call that raised stands for.
_FAULTED = object()


def _timed(fn: Call, stats: NodeStats, hook: str) -> Call:
    clock = time.perf_counter

    def timed(*args: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args)
        finally:
            stats.add_time(hook, clock() - t0)

    return timed


def _data_or_none(data: dict[str, Any]) -> dict[str, Any] | None:
    return data or None


def _noop(*args: Any) -> None:
    return None


def _fixed_arity_dispatch(
    hook: str,
    calls: list[tuple[str, Call]],
    fault: Callable[[str, str, BaseException], None],
    arity: int,
) -> Call | None:
    """An untimed dispatch taking exactly ``arity`` positional arguments (a call
    with ``*args`` costs more than one with fixed arguments), or None if there is
    no such variant."""
    if len(calls) == 1:
        ((node_id, fn),) = calls
        if arity == 0:

            def one0() -> None:
                try:
                    fn()
                except Exception as exc:
                    fault(node_id, hook, exc)

            return one0
        if arity == 1:

            def one1(a: Any) -> None:
                try:
                    fn(a)
                except Exception as exc:
                    fault(node_id, hook, exc)

            return one1
        if arity == 3:

            def one3(a: Any, b: Any, c: Any) -> None:
                try:
                    fn(a, b, c)
                except Exception as exc:
                    fault(node_id, hook, exc)

            return one3
        return None
    if arity == 0:

        def each0() -> None:
            for node_id, fn in calls:
                try:
                    fn()
                except Exception as exc:
                    fault(node_id, hook, exc)

        return each0
    if arity == 1:

        def each1(a: Any) -> None:
            for node_id, fn in calls:
                try:
                    fn(a)
                except Exception as exc:
                    fault(node_id, hook, exc)

        return each1
    if arity == 3:

        def each3(a: Any, b: Any, c: Any) -> None:
            for node_id, fn in calls:
                try:
                    fn(a, b, c)
                except Exception as exc:
                    fault(node_id, hook, exc)

        return each3
    return None


def _none() -> None:
    return None


def _false() -> bool:
    return False


def _drop_args(fn: Call) -> Call:
    return lambda *args: fn()


def _no_events() -> Iterable[Any]:
    return ()


def _takes_kwargs(fn: Call) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _block_size(kv_cache_config: Any) -> int:
    try:
        return int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    except (AttributeError, IndexError, TypeError):
        return 0
