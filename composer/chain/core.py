"""The chain: one pipeline's nodes in one vLLM process, with MultiConnector semantics.

This module creates the nodes and (re)binds the call lists; the parts live
beside it: :mod:`.calls` (binding the call lists), and the hooks, each a method
looping over its list: :mod:`.scheduler` (scheduler side: its per-step and
once-only hooks, over :mod:`.loads`, planning a request's load, and :mod:`.holds`,
holding a finished request's blocks) and :mod:`.worker_output` (the workers'
output, on the scheduler), :mod:`.worker` (worker side), :mod:`.reports` (stats and events); then
:mod:`.fault_policy` and :mod:`.faults` (a node's failure), :mod:`.metadata`
(what crosses between the two processes). How each hook's results
combine, which nodes it goes to and when it is timed are its row of
:data:`composer.hookspecs.HOOKS`.

Nothing here imports torch or vLLM: vLLM's objects pass through untouched, and
the vLLM adapter (:mod:`composer.vllm.connector`) wraps results in vLLM's types.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy
import structlog

from composer.chain.base import VllmProcess
from composer.chain.calls import Call, bind_calls, timed, traced
from composer.chain.fault_policy import FaultPolicy
from composer.chain.faults import WorkerLedger
from composer.chain.metadata import ChainMetadata, ChainWorkerMetadata, TransferResults
from composer.chain.reports import Reports
from composer.chain.scheduler import SchedulerSide
from composer.chain.worker import WorkerSide
from composer.chain.worker_output import WorkerOutput
from composer.hookspecs import HOOKS, PROJECT, Every, Nodes, NodeSpec
from composer.pipeline import ResolvedPipeline
from composer.plugin import NodeContext
from composer.stats import Changes, NodeStats
from composer.validation.deep_check import unsupported_hookimpl_options

log = structlog.get_logger("kv_composer")


class Chain(SchedulerSide, WorkerOutput, WorkerSide, Reports, FaultPolicy):
    """The nodes of one pipeline in one vLLM process.

    Each hook vLLM calls is a method that runs the hook's call list (rebuilt
    when a node is switched off), in the part of the chain that owns it.
    """

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        process: VllmProcess,
        *,
        vllm_config: Any = None,
        kv_cache_config: Any = None,
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
        self.pipeline, self.process = pipeline, process
        self.metadata_type, self.worker_metadata_type = metadata_type, worker_metadata_type
        self.transfer_results_type, self.stats_type = transfer_results_type, stats_type
        self.restore_worker_meta = restore_worker_meta
        self.log = log.bind(process=process)
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(NodeSpec)
        self.nodes, self.stats, self.policy, self.plugin_names = {}, {}, {}, {}
        self.stats_changes = Changes()
        self._create_nodes(vllm_config, kv_cache_config)
        self.disabled = set()
        self.outages = {}
        self.parting_events = []
        self.chosen, self.served, self.pending_loads, self.refused = {}, {}, {}, {}
        self.new_holds, self.new_async_loads = {}, {}
        self.block_size = _block_size(kv_cache_config)
        self.num_groups = _num_groups(kv_cache_config)
        self.converted, self.converted_loads = set(), []
        self.ledger = WorkerLedger()
        self.load_error_blocks, self.step_loads = set(), {}
        self.released, self.failed_recving, self.unreported_disabled = set(), set(), set()
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
        if nodes is Nodes.LOOKUP:
            order = list(self.pipeline.load_order)
        elif nodes is Nodes.LOADERS:
            order = [n for n in order if n in self.pipeline.load_order]
        elif nodes is Nodes.SAVERS:
            order = [n for n in order if n in self.pipeline.save_to]
        return [n for n in order if n in self.nodes and n not in self.disabled]

    def rebind(self) -> None:
        """(Re)build every hook's call list, and what each side derives from them."""
        directs = {
            node_id: node.direct_hooks() if hasattr(node, "direct_hooks") else {}
            for node_id, node in self.nodes.items()
        }
        self.lists = bind_calls(self.pm, self.order_for, directs, self._wrap)
        self.calls = self.lists.calls
        self._bind_worker()
        self._bind_scheduler()
        self._bind_worker_output()

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


def _block_size(kv_cache_config: Any) -> int:
    """Tokens per block of the finest group (a mamba group's block spans the model length)."""
    try:
        return min(int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups)
    except (AttributeError, TypeError, ValueError):
        return 0


def _num_groups(kv_cache_config: Any) -> int:
    try:
        return max(1, len(kv_cache_config.kv_cache_groups))
    except (AttributeError, TypeError):
        return 1
