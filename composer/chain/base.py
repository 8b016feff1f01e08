"""The state every part of the chain shares, declared once.

:class:`~composer.chain.Chain` is assembled from one class per job (scheduler
side, worker side, fault policy, reports); each reads and writes the attributes
declared here, which ``Chain.__init__`` sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from composer.chain.calls import Call, CallLists
from composer.chain.faults import Outage, WorkerLedger
from composer.chain.metadata import ChainMetadata, ChainWorkerMetadata
from composer.hookspecs import STORE_CALLS
from composer.pipeline import ResolvedPipeline
from composer.plugin_types import VllmProcess
from composer.stats import Changes, NodeStats


class ChainBase:
    pipeline: ResolvedPipeline
    process: VllmProcess
    log: Any
    #: Node id -> its instance in this process, in pipeline order.
    nodes: dict[str, Any]
    stats: dict[str, NodeStats]
    #: Marked by any write to any node's counters; cleared by each report.
    stats_changes: Changes
    #: Node id -> its ``on_error`` policy.
    policy: dict[str, str]
    plugin_names: dict[str, str]
    #: Switched off in this process, for good.
    disabled: set[str]
    #: Nodes whose store is away (they raised Unavailable), until a store call returns.
    outages: dict[str, Outage]
    #: Events of nodes switched off since the last ``take_events`` (scheduler side).
    parting_events: list[Any]
    lists: CallLists
    #: Hook -> (node id, callable), in dispatch order: ``lists.calls``.
    calls: dict[str, list[tuple[str, Call]]]

    # The types results are built with (the vLLM adapter passes vLLM's own).
    metadata_type: type[ChainMetadata]
    worker_metadata_type: type[ChainWorkerMetadata]
    transfer_results_type: Callable[[], Any]
    stats_type: Callable[..., Any] | None
    restore_worker_meta: bool

    # Scheduler side.
    #: Request -> its load's ranges, in order (``scheduler.Range``: one per node serving it).
    chosen: dict[str, list[Any]]
    #: Request -> its ranges' loads as planned and settled (``scheduler.PlannedLoad``).
    served: dict[str, list[Any]]
    pending_loads: dict[str, set[int]]
    #: Request -> why its tier controls were refused (told in its kv_transfer_params).
    refused: dict[str, str]
    #: Sent with the next step's metadata.
    new_holds: dict[str, tuple[str, ...]]
    #: Request -> its ranges' (node, blocks it loads, a sync load the chain reports
    #: done): loads that are async for vLLM (see ``ChainMetadata.async_loads``).
    new_async_loads: dict[str, tuple[tuple[str, frozenset[int], bool], ...]]
    block_size: int
    #: KV cache groups vLLM runs. With several, vLLM cannot map failed block ids
    #: to requests (it stops the engine), so every load goes through its
    #: async-load protocol and a failure fails the request's load as a whole.
    num_groups: int
    #: Requests with a sync range the chain made async for vLLM (several groups,
    #: or ranges of both kinds).
    converted: set[str]

    # Worker side.
    ledger: WorkerLedger
    load_error_blocks: set[int]
    step_loads: dict[str, set[int]]
    #: Requests released or failed by the chain itself (a node switched off).
    released: set[str]
    failed_recving: set[str]
    #: Switched off here, not yet told to the scheduler.
    unreported_disabled: set[str]
    #: Sync ranges the chain reports done once ``start_load_kv`` ran: (node, request).
    converted_loads: list[tuple[str, str]]

    def call_each(self, hook: str, *args: Any, per_node: dict[str, Any] | None = None) -> None:
        """Every node of ``hook``'s call list, in order: the node loop of the hooks that
        return nothing. ``per_node``: each node gets its own entry as the first argument.
        A failure goes to the node's policy; a store call that returns ends its outage.
        The per-layer and per-step hooks keep loops of their own, written out: this
        one's generality cost a quarter of the worker step (``make bench``'s dispatch
        table, with every method overridden: 1.2x MultiConnector's, against 0.9x)."""
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
                # The node's store away: no result, nothing held for it.
                result = None if self.fault(node_id, hook, exc) else default
            out.append((node_id, result))
        return out

    if TYPE_CHECKING:

        def fault(self, node_id: str, hook: str, exc: BaseException) -> bool: ...

        def store_back(self, node_id: str) -> None: ...

        def owned_events(self, node_id: str, events: Iterable[Any]) -> Iterable[Any]: ...

        def switch_off(self, node_id: str, reason: str, **where: Any) -> None: ...

        def settle_loads(self, invalid_block_ids: set[int], failed_recving: set[str]) -> None: ...

        def rebind(self) -> None: ...
