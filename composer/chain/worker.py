"""The workers' chain: the per-layer fast path, per-step loads and saves, finished transfers.

The worker half receives each step's :class:`ChainMetadata` (each node its own
entry, plus the holds, loads and switch-offs the scheduler half decided), runs
the nodes' loads and saves, and reports finished transfers: a request's blocks
are freed when the last node holding them is done (the :class:`WorkerLedger`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from composer.chain.calls import Call, takes_kwargs
from composer.chain.core import ChainCore
from composer.chain.faults import WorkerLedger
from composer.chain.metadata import ChainMetadata, ChainWorkerMetadata, TransferResults
from composer.hook_table import hooks_where
from composer.hookspecs import STORE_CALLS
from composer.pipeline import ResolvedPipeline
from composer.plugin_types import VllmProcess


class WorkerChain(ChainCore):
    """A worker process's hooks: each a method looping over its call list."""

    process: VllmProcess = "worker"

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        *,
        vllm_config: Any = None,
        kv_cache_config: Any = None,
        stats_type: Callable[..., Any] | None = None,
        worker_metadata_type: type[ChainWorkerMetadata] = ChainWorkerMetadata,
        transfer_results_type: Callable[[], Any] = TransferResults,
    ) -> None:
        """``*_type``: the classes the chain builds its results with (the vLLM
        adapter passes vLLM's own, or subclasses of them, so results need no copy)."""
        self.worker_metadata_type = worker_metadata_type
        self.transfer_results_type = transfer_results_type
        #: The step's metadata, from bind_connector_metadata to clear_connector_metadata.
        self.metadata: ChainMetadata | None = None
        self.ledger = WorkerLedger()
        #: Blocks that failed to load through the chain itself (a fault, a switch-off).
        self.load_error_blocks: set[int] = set()
        #: Node -> the blocks it loads this step (the metadata's ``loads``).
        self.step_loads: dict[str, set[int]] = {}
        #: Requests released or failed by the chain itself (a node switched off).
        self.released: set[str] = set()
        self.failed_recving: set[str] = set()
        #: Switched off here, not yet told to the scheduler.
        self.unreported_disabled: set[str] = set()
        #: Sync ranges the chain reports done once ``start_load_kv`` ran: (node, request).
        self.made_async_loads: list[tuple[str, str]] = []
        super().__init__(
            pipeline,
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            stats_type=stats_type,
        )

    def _bind(self) -> None:
        calls = self.calls
        #: ``calls["wait_for_layer_load"]`` and ``calls["save_kv_layer"]``: one
        #: attribute each, as a dict lookup per layer shows.
        self.layer_loads, self.layer_saves = calls["wait_for_layer_load"], calls["save_kv_layer"]
        direct, via_finished = dict(calls["get_transfer_results"]), dict(calls["get_finished"])
        #: (node id, callable, returns TransferResults?): ``get_transfer_results``, or
        #: ``get_finished`` for a node without it, in node order.
        self.transfer_calls: list[tuple[str, Call, bool]] = [
            (n, direct[n], True) if n in direct else (n, via_finished[n], False)
            for n in self.nodes
            if n not in self.disabled and (n in direct or n in via_finished)
        ]
        #: The hooks vLLM may pass keyword arguments to: (node id, callable, takes them?).
        self.kwargs_calls: dict[str, list[tuple[str, Call, bool]]] = {
            hook: [(node_id, fn, takes_kwargs(fn)) for node_id, fn in calls[hook]]
            for hook in hooks_where(passes_kwargs=True)
        }

    # -- what a fault costs the worker (ChainCore.fault, switch_off) -------------- #

    def _fail_step_loads(self, node_id: str) -> tuple[int, int]:
        step = self.step_loads.get(node_id, set())
        new = len(step - self.load_error_blocks)
        self.load_error_blocks |= step
        return len(step), new

    def _loads_async(self, node_id: str) -> bool:
        return self.ledger.has_async_loads(node_id)

    def _hand_back(self, node_id: str) -> tuple[int, int, int]:
        self.unreported_disabled.add(node_id)
        _, blocks = self._fail_step_loads(node_id)
        done = self.ledger.release(node_id)
        _, loading = self.ledger.drop_loads(node_id)
        self.released |= done
        # (A request that other nodes still load is reported when they are done.)
        self.failed_recving |= loading
        return blocks, len(done), len(loading)

    # -- per layer, the hot path: one Python call per implementing node ------- #

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Every loading node that implements it, in pipeline order."""
        for node_id, fn in self.layer_loads:
            try:
                fn(layer_name)
            except Exception as exc:
                self.fault(node_id, "wait_for_layer_load", exc)
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Every saving node that implements it, in pipeline order."""
        if kwargs:
            args = (layer_name, kv_layer, attn_metadata)
            return self.call_passing_kwargs("save_kv_layer", args, kwargs)
        for node_id, fn in self.layer_saves:
            try:
                fn(layer_name, kv_layer, attn_metadata)
            except Exception as exc:
                self.fault(node_id, "save_kv_layer", exc)
        return None

    def call_passing_kwargs(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """vLLM passed keyword arguments (0.32.0 passes none; later versions do): they
        reach the callables that take them (a native connector's own method)."""
        for node_id, fn, fn_takes_kwargs in self.kwargs_calls[hook]:
            try:
                if fn_takes_kwargs:
                    fn(*args, **kwargs)
                else:
                    fn(*args)
            except Exception as exc:
                self.fault(node_id, hook, exc)
                continue
            if node_id in self.outages and hook in STORE_CALLS:
                self.store_back(node_id)

    # -- per step, before the forward ----------------------------------------- #

    def handle_preemptions(self, metadata: ChainMetadata) -> None:
        per_node = metadata.per_node
        for node_id, fn in self.calls["handle_preemptions"]:
            try:
                fn(per_node.get(node_id))
            except Exception as exc:
                self.fault(node_id, "handle_preemptions", exc)

    def bind_connector_metadata(self, metadata: ChainMetadata) -> None:
        """Each node gets its own entry; the holds, loads and switch-offs the
        scheduler decided are taken first."""
        off = self.disabled
        if metadata.disabled and not metadata.disabled <= off:
            for node_id in sorted(metadata.disabled - off):
                self.switch_off(node_id, "switched off in the scheduler")
        if metadata.holds or metadata.async_loads or off:
            self._take_holds_and_loads(metadata, off)
        self.step_loads = metadata.loads
        self.metadata = metadata
        per_node = metadata.per_node
        for node_id, fn in self.calls["bind_connector_metadata"]:
            try:
                fn(per_node.get(node_id))
            except Exception as exc:
                self.fault(node_id, "bind_connector_metadata", exc)

    def _take_holds_and_loads(self, metadata: ChainMetadata, off: set[str]) -> None:
        ledger = self.ledger
        if metadata.holds:
            for req_id, holders in metadata.holds.items():
                live = [n for n in holders if n not in off]
                if live:
                    ledger.hold(req_id, live)
                else:
                    self.released.add(req_id)
        if metadata.async_loads:
            for req_id, ranges in metadata.async_loads.items():
                alive = {r.node for r in ranges if r.node not in off}
                if not alive:
                    self.failed_recving.add(req_id)
                    continue
                blocks = frozenset().union(*(r.block_ids() for r in ranges))
                sync = [r.node for r in ranges if r.reported_by_chain and r.node in alive]
                ledger.loading(req_id, alive, blocks, sync=sync, failed=len(alive) < len(ranges))
                self.made_async_loads += [(n, req_id) for n in sync]
        loads = metadata.loads
        for node_id in off:
            # A switched-off node loads nothing: vLLM recomputes what it was to load.
            self.load_error_blocks |= loads.get(node_id, set())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Every loading node: start (or do) its loads for this step."""
        if kwargs:  # (vLLM 0.32.0 passes none)
            return self.call_passing_kwargs("start_load_kv", (forward_context,), kwargs)
        for node_id, fn in self.calls["start_load_kv"]:
            try:
                fn(forward_context)
            except Exception as exc:
                self.fault(node_id, "start_load_kv", exc)
                continue
            if node_id in self.outages:
                self.store_back(node_id)
        return None

    # -- per step, after the forward ------------------------------------------ #

    def wait_for_save(self) -> None:
        for node_id, fn in self.calls["wait_for_save"]:
            try:
                fn()
            except Exception as exc:
                self.fault(node_id, "wait_for_save", exc)
                continue
            if node_id in self.outages:
                self.store_back(node_id)

    def finish_forward(self) -> None:
        for node_id, fn in self.calls["finish_forward"]:
            try:
                fn()
            except Exception as exc:
                self.fault(node_id, "finish_forward", exc)

    def clear_connector_metadata(self) -> None:
        self.step_loads = {}
        self.metadata = None
        for node_id, fn in self.calls["clear_connector_metadata"]:
            try:
                fn()
            except Exception as exc:
                self.fault(node_id, "clear_connector_metadata", exc)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Finished loads once every node loading a request is done; finished saves
        once the last node holding a request is."""
        results, ledger = self.transfer_results_type(), self.ledger
        if self.num_groups > 1 and ledger.loads_in_flight():
            # (Otherwise get_block_ids_with_load_errors drains them: not twice a step.)
            self._fail_lost_blocks()
        if self.released or self.failed_recving:
            self._chain_own_results(results)
        if self.made_async_loads:
            # Sync ranges the chain made async for vLLM: done once start_load_kv ran.
            for node_id, req_id in self.made_async_loads:
                _received(results, *ledger.received(node_id, (req_id,)))
            self.made_async_loads = []
        for node_id, fn, is_direct in self.transfer_calls:
            try:
                if is_direct:
                    r = fn(finished_req_ids)
                    sending, recving = r.finished_sending, r.finished_recving
                    if r.failed_recving:
                        ledger.fail_requests(r.failed_recving)
                        recving = set(recving or ()) | set(r.failed_recving)
                else:
                    sending, recving = fn(finished_req_ids)
            except Exception as exc:
                self.fault(node_id, "get_transfer_results" if is_direct else "get_finished", exc)
                continue
            if recving:
                _received(results, *ledger.received(node_id, recving))
            if sending:
                results.finished_sending.update(ledger.sent(node_id, sending))
        return results

    def _fail_lost_blocks(self) -> None:
        """Several groups: a load that lost a block fails as a whole (vLLM takes no
        block ids then)."""
        errors = self._drain_load_errors()
        if errors:
            self.ledger.fail_blocks(errors)

    def _chain_own_results(self, results: Any) -> None:
        if self.released:
            # Held only by nodes that were switched off.
            results.finished_sending.update(self.released)
            self.released = set()
        if self.failed_recving:
            # Loading through a node that was switched off: vLLM recomputes them.
            results.finished_recving.update(self.failed_recving)
            results.failed_recving.update(self.failed_recving)
            self.failed_recving = set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's older call: :meth:`get_transfer_results` as (sending, receiving)."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def reset_capture_state(self) -> None:
        self.call_each("reset_capture_state")

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.num_groups > 1:  # failed per request instead (see get_transfer_results)
            self._fail_lost_blocks()
            return set()
        return self._drain_load_errors()

    def _drain_load_errors(self) -> set[int]:
        """The blocks that failed to load since the last call: the nodes' and the chain's."""
        blocks: set[int] = set()
        for node_id, fn in self.calls["get_block_ids_with_load_errors"]:
            try:
                failed = fn()
            except Exception as exc:
                self.fault(node_id, "get_block_ids_with_load_errors", exc)
                continue
            if failed:
                blocks |= failed
        if self.load_error_blocks:  # (after the nodes: a fault above may have added some)
            blocks |= self.load_error_blocks
            self.load_error_blocks = set()
        return blocks

    def build_connector_worker_meta(self) -> ChainWorkerMetadata | None:
        """Each node's metadata for its scheduler half, and the nodes switched off here."""
        calls = self.calls["build_connector_worker_meta"]
        if not calls and not self.unreported_disabled:
            return None
        per_node = {}
        for node_id, fn in calls:
            try:
                meta = fn()
            except Exception as exc:
                self.fault(node_id, "build_connector_worker_meta", exc)
                continue
            if meta is not None:
                per_node[node_id] = meta
        if self.unreported_disabled:
            # The scheduler half of a node switched off here must stop too.
            off, self.unreported_disabled = frozenset(self.unreported_disabled), set()
            return self.worker_metadata_type(per_node, off)
        return self.worker_metadata_type(per_node) if per_node else None

    def get_kv_connector_kv_cache_events(self) -> Any:
        """The nodes' KV cache events, merged (``a.merge(b)``) in node order."""
        merged = None
        for node_id, fn in self.calls["get_kv_connector_kv_cache_events"]:
            try:
                events = fn()
            except Exception as exc:
                self.fault(node_id, "get_kv_connector_kv_cache_events", exc)
                continue
            if events is not None:
                merged = events if merged is None else merged.merge(events)
        return merged

    # -- once, at start ------------------------------------------------------- #

    def initialize_worker_connector(
        self, model: Any, vllm_config: Any, kv_cache_config: Any
    ) -> None:
        self.call_each("initialize_worker_connector", model, vllm_config, kv_cache_config)

    def get_mem_pool_context(self) -> Any:
        found = [(n, c) for n, c in self.results("get_mem_pool_context") if c is not None]
        if len(found) > 1:
            # MultiConnector's rule and wording: KV cache lives in one pool.
            raise ValueError(
                f"Multiple connectors provide a KV cache memory pool {[n for n, _ in found]}; "
                "KV cache is allocated once and can only live in one pool. "
                "Configure custom_mem_pool on at most one connector."
            )
        return found[0][1] if found else None

    def register_kv_caches(self, canonical: Any, raw: dict[str, Any]) -> None:
        self.call_each("register_kv_caches", canonical, raw)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self.call_each("set_host_xfer_buffer_ops", copy_operation)

    def get_handshake_metadata(self) -> Any:
        for _, meta in self.results("get_handshake_metadata"):
            if meta is not None:
                return meta
        return None

    # -- sleep mode: on demand ---------------------------------------------- #

    def unregister_kv_caches(self) -> None:
        self.call_each("unregister_kv_caches")

    def restore_kv_caches(self, canonical: Any, raw: dict[str, Any]) -> None:
        self.call_each("restore_kv_caches", canonical, raw)


def _received(results: Any, done: set[str], failed: set[str]) -> None:
    """Requests every node finished loading; the failed ones are recomputed by vLLM."""
    results.finished_recving.update(done)
    if failed:
        results.failed_recving.update(failed)
