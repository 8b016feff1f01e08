"""The chain: one pipeline's nodes in one vLLM process, with MultiConnector semantics.

vLLM builds a connector in each process and, like vLLM's own connectors, the
chain is one object per process, chosen by role (:func:`.role.chain_for`):

* :class:`ChainCore` (here): what both processes share. It creates this
  process's nodes, binds each hook's call list (:mod:`.calls`), applies a
  node's fault policy (switching it off, its store's outages: :mod:`.faults`),
  keeps the per-node stats, and runs the hooks either process calls.
* :class:`~.scheduler.SchedulerChain`: the scheduler's hooks (each step's
  metadata, the workers' output, events: :mod:`.reports`), with two parts mixed
  in: :class:`~.loads.LoadPlanning` (a request's load) and
  :class:`~.holds.BlockHolding` (a finished request's blocks).
* :class:`~.worker.WorkerChain`: the workers' hooks, per layer and per step, with
  the worker's state (its ledger of held and loading requests, the step's loads).

:mod:`.metadata` is what crosses between the two. A hook's process, combine
rule, nodes and timing are its row of :data:`composer.hook_table.HOOKS` (a test
checks that every row is a method of its process's chain).

Nothing here imports torch or vLLM: vLLM's objects pass through untouched, and
the vLLM adapter (:mod:`composer.vllm.connector`) wraps results in vLLM's types.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pluggy
import structlog

from composer.chain.calls import Call, CallLists, bind_calls, timed, traced
from composer.chain.faults import NodeFailed, Outage, Unavailable
from composer.hook_table import HOOKS, Away, Every, Nodes, Recompute
from composer.hookspecs import PROJECT, STORE_CALLS, NodeSpec
from composer.pipeline import ResolvedPipeline
from composer.plugin import NodeContext
from composer.plugin_types import VllmProcess
from composer.stats import Changes, NodeStats
from composer.validation.deep_check import unsupported_hookimpl_options

log = structlog.get_logger("kv_composer")


def is_outage(hook: str, exc: BaseException) -> bool:
    """Whether ``exc``, raised by a node's ``hook``, is its store away (:class:`Unavailable`
    where the hook table says what an outage there costs), not a fault: the caller
    drops the node's result and holds nothing for it."""
    return isinstance(exc, Unavailable) and HOOKS[hook].away is not Away.FAULT


class ChainCore:
    """The nodes of one pipeline in one vLLM process, and what both processes do with them.

    Each hook vLLM calls is a method of the process's chain that runs the hook's
    call list (rebuilt when a node is switched off). A side adds its hooks and
    says, through the ``_``-methods it overrides, what a fault costs its state.
    """

    #: The vLLM process this chain runs in (each side sets its own).
    process: VllmProcess

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        *,
        vllm_config: Any = None,
        kv_cache_config: Any = None,
        stats_type: Callable[..., Any] | None = None,
    ) -> None:
        """``stats_type(data=...)`` wraps what ``get_kv_connector_stats`` returns (the
        vLLM adapter passes a subclass of vLLM's own type, so nothing is copied)."""
        self.pipeline = pipeline
        self.stats_type = stats_type
        self.log: Any = log.bind(process=self.process)
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(NodeSpec)
        #: Node id -> its instance in this process, in pipeline order.
        self.nodes: dict[str, Any] = {}
        self.stats: dict[str, NodeStats] = {}
        #: Node id -> its ``on_error`` policy.
        self.policy: dict[str, str] = {}
        self.plugin_names: dict[str, str] = {}
        #: Marked by any write to any node's counters; cleared by each report.
        self.stats_changes = Changes()
        self._create_nodes(vllm_config, kv_cache_config)
        #: Switched off in this process, for good.
        self.disabled: set[str] = set()
        #: Nodes whose store is away (they raised Unavailable), until a store call returns.
        self.outages: dict[str, Outage] = {}
        #: KV cache groups vLLM runs. With several, vLLM cannot map failed block ids
        #: to requests (it stops the engine), so every load goes through its
        #: async-load protocol and a failure fails the request's load as a whole.
        self.num_groups = num_groups(kv_cache_config)
        self.lists = CallLists()
        #: Hook -> (node id, callable), in dispatch order: ``lists.calls``.
        self.calls: dict[str, list[tuple[str, Call]]] = {}
        # (A side sets its own state before this: binding derives its lists.)
        self.rebind()

    def _create_nodes(self, vllm_config: Any, kv_cache_config: Any) -> None:
        services: dict[str, Any] = {}
        for rnode in self.pipeline.nodes:
            if self.process not in rnode.plugin.processes:
                continue
            ctx = NodeContext(
                node_id=rnode.id,
                config=rnode.config,
                role=rnode.role,
                process=self.process,
                needs={d: services[d] for d in rnode.needs if d in services},
                on_error=rnode.on_error,
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                stats=NodeStats(changes=self.stats_changes),
            )
            instance = rnode.plugin.node_class(self.process, rnode.config)(ctx)
            self.pm.register(instance, name=rnode.id)
            self.nodes[rnode.id] = instance
            self.stats[rnode.id] = ctx.stats
            self.policy[rnode.id] = rnode.on_error
            self.plugin_names[rnode.id] = rnode.plugin.name
            services[rnode.id] = instance.service()
            self.log.debug("node created", node=rnode.id, plugin=rnode.plugin.name)
        # A misspelled @hookimpl is an error, not a silently skipped node; so is
        # an option the chain would ignore (nodes are called once each, in order).
        # (At engine start this is the one check of the node classes; `kvc
        # validate --deep` checks them before launch, with did-you-mean.)
        self.pm.check_pending()
        ignored = [
            f"node {node_id!r} hook {hook!r}: {option}=True"
            for node_id, node in self.nodes.items()
            for hook, option in unsupported_hookimpl_options(type(node))
        ]
        if ignored:
            raise ValueError(
                "hookimpl options KV Composer does not honour (nodes are called once "
                "each, in pipeline order): " + "; ".join(ignored)
            )
        if self.pipeline.trace:
            self.pm.trace.root.setwriter(lambda msg: self.log.debug("hook", trace=msg.rstrip()))

    # -- binding ----------------------------------------------------------------- #

    def order_for(self, hook: str) -> list[str]:
        """The nodes ``hook`` is dispatched to, in order (its row's ``nodes``)."""
        nodes, order = HOOKS[hook].nodes, [n.id for n in self.pipeline.nodes]
        if nodes is Nodes.LOADERS_IN_LOAD_ORDER:
            order = list(self.pipeline.load_order)
        elif nodes is Nodes.LOADERS:
            order = [n for n in order if n in self.pipeline.load_order]
        elif nodes is Nodes.SAVERS:
            order = [n for n in order if n in self.pipeline.save_to]
        return [n for n in order if n in self.nodes and n not in self.disabled]

    def rebind(self) -> None:
        """(Re)build every hook's call list, and what the side derives from them."""
        directs = {
            node_id: node.direct_hooks() if hasattr(node, "direct_hooks") else {}
            for node_id, node in self.nodes.items()
        }
        self.lists = bind_calls(self.pm, self.order_for, directs, self._wrap)
        self.calls = self.lists.calls
        self._bind()

    def _bind(self) -> None:
        """A side's own lists, cached as attributes for its hot paths."""

    def _wrap(self, node_id: str, hook: str, fn: Call) -> Call:
        if self._timed(HOOKS[hook].every):
            fn = timed(fn, self.stats[node_id], hook)
        if self.pipeline.trace:
            fn = traced(fn, node_id, hook, self.pm)
        return fn

    def _timed(self, every: Every) -> bool:
        """Whether a hook called this often is timed in the per-node stats (``hook_seconds``)."""
        if every is Every.LAYER:
            return self.pipeline.time_layer_hooks
        if every is Every.STEP:
            return self.pipeline.time_step_hooks
        return True  # once, on demand, per request: rare enough to time always

    def implemented(self, hook: str) -> list[str]:
        return [n for n, _ in self.calls.get(hook, ())]

    # -- calling the nodes -------------------------------------------------------- #

    def call_each(self, hook: str, *args: Any, per_node: dict[str, Any] | None = None) -> None:
        """Every node of ``hook``'s call list, in order: the node loop of the hooks that
        return nothing. ``per_node``: each node gets its own entry as the first argument.
        A failure goes to the node's policy; a store call that returns ends its outage.
        The per-layer and per-step hooks keep loops of their own, written out: this
        one's generality costs too much there (``docs/running.md``, "Hot paths")."""
        store = hook in STORE_CALLS
        for node_id, fn in self.calls[hook]:
            try:
                if per_node is None:
                    fn(*args)
                else:
                    fn(per_node.get(node_id), *args)
            except Exception as exc:
                self.fault(node_id, hook, exc)
                continue
            if store and node_id in self.outages:
                self.store_back(node_id)

    def results(self, hook: str, *args: Any, default: Any = None) -> list[tuple[str, Any]]:
        """(node id, result) of every node implementing ``hook``; a failed one gives ``default``.

        For one-time and per-request hooks; the per-step and per-layer ones have
        a method each, with its own loop.
        """
        out = []
        for node_id, fn in self.calls[hook]:
            try:
                result = fn(*args)
            except Exception as exc:
                self.fault(node_id, hook, exc)
                # The node's store away: no result, nothing held for it.
                result = None if is_outage(hook, exc) else default
            out.append((node_id, result))
        return out

    # -- either process ------------------------------------------------------------ #

    def reset_cache(self) -> bool:
        return all(r is not False for _, r in self.results("reset_cache"))

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

    def take_stats(self) -> dict[str, dict[str, Any]]:
        """Every node's counters and own stats since the last report, by node id.

        A node's counters (:class:`NodeStats`) are reported only when something was
        counted: every write marks a flag shared by the chain's nodes, so a quiet
        step costs one check. A node's own ``get_kv_connector_stats`` result
        travels beside its counters."""
        out = self.get_kv_connector_stats()
        return getattr(out, "data", out) or {}

    def get_kv_connector_stats(self) -> Any:
        """:meth:`take_stats` wrapped in vLLM's stats type (``stats_type``); None if empty."""
        own: dict[str, Any] | None = None
        for node_id, fn in self.calls["get_kv_connector_stats"]:
            try:
                node_stats = fn()
            except Exception as exc:
                self.fault(node_id, "get_kv_connector_stats", exc)
                continue
            if node_stats is not None:
                if own is None:
                    own = {}
                own[node_id] = node_stats
        if own is None and not self.stats_changes.seen:
            return None  # the usual step: no node counted anything
        # Cleared before reading, so a count made meanwhile (a node's own
        # thread) marks it again for the next report instead of being lost.
        self.stats_changes.seen = False
        out: dict[str, dict[str, Any]] = {}
        for node_id, stats in self.stats.items():
            node_stats = own.get(node_id) if own else None
            if node_stats is None and stats.is_empty():
                continue
            entry: dict[str, Any] = {
                "plugin": self.plugin_names[node_id],
                "counters": stats.take(),
            }
            if node_stats is not None:
                entry["node"] = node_stats
            out[node_id] = entry
        if not out:
            return None
        return self.stats_type(data=out) if self.stats_type is not None else out

    # -- a node's fault (the policies: composer.chain.faults) --------------------- #

    def fault(self, node_id: str, hook: str, exc: BaseException) -> None:
        """Apply the node's error policy to ``exc``, raised by its ``hook``; returns only
        if the engine goes on, with nothing the node failed to load served. An
        outage (:func:`is_outage`: the node's store away) is no fault: counted as
        such, the node stays on."""
        if is_outage(hook, exc):
            self.store_away(node_id, hook, exc)
            return
        policy = self.policy.get(node_id, "fail")
        recompute = HOOKS[hook].recompute
        stats = self.stats[node_id]
        stats.errors += 1
        stats.extra.add(f"errors_{hook}")
        where = {"node": node_id, "hook": hook, "error": repr(exc)}
        if policy == "fail":
            if recompute is Recompute.BLOCKS_RECOMPUTED:
                self._fail_step_loads(node_id)
            self.log.error("node failed; on_error: fail stops the engine", **where)
            raise NodeFailed(node_id, self.plugin_names.get(node_id, "?"), hook, exc) from exc
        if policy == "recompute" and self._recovered(recompute, where):
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
        self.switch_off(node_id, reason, **where)
        return

    def store_away(self, node_id: str, hook: str, exc: BaseException) -> None:
        """The node's store is away: count the call, recompute what it was loading."""
        stats = self.stats[node_id]
        stats.unavailable[hook] = stats.unavailable.get(hook, 0) + 1
        stats.changes.seen = True
        blocks = 0
        if HOOKS[hook].away is Away.BLOCKS_RECOMPUTED:
            _, blocks = self._fail_step_loads(node_id)
            if blocks:
                stats.extra.add("blocks_recomputed", blocks)
        outage = self.outages.get(node_id)
        if outage is None:
            outage = self.outages[node_id] = Outage(time.monotonic())
            stats.extra.add("outages")
            stats.gauges["store_away"] = 1
            self.log.warning(
                "node's store is away: the node stays on, vLLM recomputes what it would "
                "have served or saved until it is back",
                node=node_id,
                hook=hook,
                error=repr(exc),
            )
        outage.calls += 1
        outage.blocks += blocks

    def store_back(self, node_id: str) -> None:
        """A lookup, load or save of the node returned normally: its outage is over."""
        outage = self.outages.pop(node_id)
        self.stats[node_id].gauges["store_away"] = 0
        self.log.warning(
            "node's store is back",
            node=node_id,
            away_s=round(time.monotonic() - outage.since, 3),
            calls_unavailable=outage.calls,
            blocks_recomputed=outage.blocks,
        )

    def _recovered(self, recompute: Recompute, where: dict[str, Any]) -> bool:
        """Whether vLLM's recompute undoes this fault (then the node stays on)."""
        node_id = where["node"]
        if recompute is Recompute.SWITCH_OFF:
            return False
        if recompute is Recompute.RESULT_LOST:
            self.log.warning("node failed; only this call's result is lost", **where)
            return True
        if self._loads_async(node_id):
            return False  # a transfer may still write into vLLM's blocks
        blocks, _ = self._fail_step_loads(node_id)
        self.stats[node_id].extra.add("blocks_recomputed", blocks)
        self.log.warning(
            "node failed while loading; vLLM recomputes the blocks it was loading",
            blocks=blocks,
            **where,
        )
        return True

    def switch_off(self, node_id: str, reason: str, **where: Any) -> None:
        """Take the node out of this process's chain for good, releasing what it held."""
        if node_id in self.disabled:
            return
        self.disabled.add(node_id)
        stats = self.stats[node_id]
        stats.disabled = True
        blocks, released, failed = self._hand_back(node_id)
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
        self._parting(node_id)
        self.log.warning(
            "node switched off",
            reason=reason,
            blocks_recomputed=blocks,
            requests_recomputed=failed,
            holds_released=released,
            **{"node": node_id, **where},
        )
        self.rebind()

    # What a fault costs a side's own state (the scheduler holds no loads of a step).

    def _fail_step_loads(self, node_id: str) -> tuple[int, int]:
        """The blocks the node loads this step become load errors (vLLM recomputes
        them): (how many it loads, how many of them were not load errors yet)."""
        return 0, 0

    def _loads_async(self, node_id: str) -> bool:
        """Whether an async load of the node is in flight (still writing into vLLM's blocks)."""
        return False

    def _hand_back(self, node_id: str) -> tuple[int, int, int]:
        """Everything the switched-off node was loading or holding goes back to vLLM:
        (blocks recomputed, holds released, requests whose load failed)."""
        return 0, 0, 0

    def _parting(self, node_id: str) -> None:
        """What the switched-off node still has to say, before it leaves the call lists."""


def block_size(kv_cache_config: Any) -> int:
    """Tokens per block of the finest group (a mamba group's block spans the model length)."""
    try:
        return min(int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups)
    except (AttributeError, TypeError, ValueError):
        return 0


def num_groups(kv_cache_config: Any) -> int:
    try:
        return max(1, len(kv_cache_config.kv_cache_groups))
    except (AttributeError, TypeError):
        return 1
