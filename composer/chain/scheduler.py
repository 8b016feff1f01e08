"""The scheduler's chain: each step's metadata, the workers' output, events, the
once-only bindings, and the two jobs of a request's life, each a part with its
own state and its own module, mixed in so that vLLM's call reaches it directly:
planning its load (:class:`~.loads.LoadPlanning`) and holding its blocks when it
finishes (:class:`~.holds.BlockHolding`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from composer.chain.calls import Call, adapt
from composer.chain.core import ChainCore, block_size
from composer.chain.holds import BlockHolding
from composer.chain.loads import LoadPlanning
from composer.chain.metadata import ChainMetadata
from composer.chain.reports import owned_events
from composer.pipeline import ResolvedPipeline
from composer.plugin_types import VllmProcess
from composer.views import RequestViews, StepView


class SchedulerChain(ChainCore, LoadPlanning, BlockHolding):
    """The scheduler process's hooks: each a method looping over its call list (the
    per-request ones in :class:`LoadPlanning` and :class:`BlockHolding`)."""

    process: VllmProcess = "scheduler"

    def __init__(
        self,
        pipeline: ResolvedPipeline,
        *,
        vllm_config: Any = None,
        kv_cache_config: Any = None,
        stats_type: Callable[..., Any] | None = None,
        metadata_type: type[ChainMetadata] = ChainMetadata,
        restore_worker_meta: bool = False,
    ) -> None:
        """``metadata_type``: the class each step's metadata is built with (the vLLM
        adapter passes a subclass of vLLM's own type, so nothing is copied).
        ``restore_worker_meta``: during ``update_connector_output`` each node finds
        its own worker metadata in the output's ``kv_connector_worker_meta`` (as
        MultiConnector's children do), and the chain's is put back after."""
        self.metadata_type = metadata_type
        self.restore_worker_meta = restore_worker_meta
        #: Events of nodes switched off since the last ``take_events``.
        self.parting_events: list[Any] = []
        super().__init__(
            pipeline,
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            stats_type=stats_type,
        )
        #: Each request's one view, from vLLM's first call about it to its end.
        self.views = RequestViews()
        self._init_loads(block_size(kv_cache_config))
        self._init_holds()

    def _bind(self) -> None:
        #: ``build_connector_meta``'s calls: with the step view and vLLM's output when
        #: some node names the step view, else with what each hookimpl names.
        self.meta_calls: list[tuple[str, Call]]
        if "step" in self.lists.wanted["build_connector_meta"]:
            self.meta_wants_step, self.meta_calls = True, self.calls["build_connector_meta"]
        else:
            # No node names it: none is built (a view per step costs).
            self.meta_wants_step = False
            self.meta_calls = [
                (node_id, adapt(fn, argnames, ("scheduler_output",)))
                for node_id, fn, argnames in self.lists.own["build_connector_meta"]
            ]
        #: (node id, callable taking (connector_output, worker_meta)), in node order.
        self.output_calls = self.calls["update_connector_output"]
        own = self.lists.own["update_connector_output"]
        native_only = self.restore_worker_meta and all(
            names == ("connector_output",) for _, _, names in own
        )
        #: Only native nodes, inside vLLM: their (node id, callable), for the loop
        #: MultiConnector runs (no argument choice); else None.
        self.output_native_only: list[tuple[str, Call]] | None = (
            [(node_id, fn) for node_id, fn, _ in own] if native_only else None
        )

    # -- per step ----------------------------------------------------------------- #

    def build_connector_meta(self, scheduler_output: Any) -> ChainMetadata:
        """Each node's metadata for its worker half, with what the workers must follow."""
        per_node, calls = {}, self.meta_calls
        # Two loops, so that the usual step builds no argument tuple.
        if self.meta_wants_step:
            step = StepView(scheduler_output)
            for node_id, fn in calls:
                try:
                    per_node[node_id] = fn(step, scheduler_output)
                except Exception as exc:
                    self.fault(node_id, "build_connector_meta", exc)
                    per_node[node_id] = None
        else:
            for node_id, fn in calls:
                try:
                    per_node[node_id] = fn(scheduler_output)
                except Exception as exc:
                    self.fault(node_id, "build_connector_meta", exc)
                    per_node[node_id] = None
        loading = self.loading
        meta = self.metadata_type(per_node, None, loading.step_load_blocks)
        loading.step_load_blocks = {}
        if self.new_holds or loading.async_loads_to_send or self.disabled:
            self._step_decisions(meta)
        return meta

    def _step_decisions(self, meta: ChainMetadata) -> None:
        """What the workers must follow this step: holds, async loads, switch-offs."""
        if self.new_holds:
            meta.holds, self.new_holds = self.new_holds, {}
        loading = self.loading
        if loading.async_loads_to_send:
            meta.async_loads, loading.async_loads_to_send = loading.async_loads_to_send, {}
        if self.disabled:
            meta.disabled = frozenset(self.disabled)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output: each node gets its own worker metadata (the entry its
        worker half built), and inside vLLM also finds it in
        ``connector_output.kv_connector_worker_meta`` during its call, as
        MultiConnector's children do. A node switched off in a worker is switched
        off here first."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        failed = getattr(connector_output, "failed_recving", None)
        if (invalid or failed) and self.loading.loads_of:
            self.settle_loads(set(invalid or ()), set(failed or ()))
        native = self.output_native_only
        # (Inside vLLM, whose output always has the field, for native nodes only.)
        if native is not None and connector_output.kv_connector_worker_meta is None:
            # The usual step for vLLM's own connectors: nothing to swap.
            for node_id, fn in native:
                try:
                    fn(connector_output)
                except Exception as exc:
                    self.fault(node_id, "update_connector_output", exc)
            return None
        calls = self.output_calls
        chain_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not calls:
            self._follow_workers(chain_meta)  # (with nothing called, nothing overwritten)
            return None
        if getattr(chain_meta, "disabled", None) and self._follow_workers(chain_meta):
            return self.update_connector_output(connector_output)  # without them
        per_node = getattr(chain_meta, "per_node", None) or {}
        swap = self.restore_worker_meta
        try:
            for node_id, fn in calls:
                meta = per_node.get(node_id)
                if swap:
                    connector_output.kv_connector_worker_meta = meta
                try:
                    fn(connector_output, meta)
                except Exception as exc:
                    self.fault(node_id, "update_connector_output", exc)
        finally:
            if swap:
                connector_output.kv_connector_worker_meta = chain_meta
        return None

    def _follow_workers(self, chain_meta: Any) -> bool:
        """Switch off here what a worker switched off; True if anything was."""
        gone = getattr(chain_meta, "disabled", None)
        if not gone or gone <= self.disabled:
            return False
        for node_id in sorted(gone - self.disabled):
            self.switch_off(node_id, "switched off in a worker")
        return True

    def take_events(self) -> Iterable[Any]:
        """The nodes' new KV cache events, one node after the other (first the last
        events of nodes switched off since the previous step)."""
        if self.parting_events:
            parting, self.parting_events = self.parting_events, []
            yield from parting
        for node_id, fn in self.calls["take_events"]:
            try:
                events = fn()
                # The usual step: an empty list or tuple, and nothing to count.
                if events:
                    yield from owned_events(node_id, events, self.stats.get(node_id))
            except Exception as exc:
                self.fault(node_id, "take_events", exc)

    def _parting(self, node_id: str) -> None:
        """The stopped node's last events (a tier's ``BlockRemoved`` for everything it
        held): published with the next step's events, since its ``take_events``
        leaves the call list now."""
        for name, fn in self.calls.get("take_events", ()):
            if name == node_id:
                try:
                    events = owned_events(node_id, fn(), self.stats.get(node_id))
                    self.parting_events.extend(events)
                except Exception as exc:
                    self.log.error(
                        "switched-off node's last events are lost", node=node_id, error=repr(exc)
                    )

    def has_pending_block_frees(self) -> bool:
        return self._any_true("has_pending_block_frees")

    def has_pending_push_work(self) -> bool:
        return self._any_true("has_pending_push_work")

    def _any_true(self, hook: str) -> bool:
        found = False  # every node is asked, as with any()
        for node_id, fn in self.calls[hook]:
            try:
                if fn():
                    found = True
            except Exception as exc:
                self.fault(node_id, hook, exc)
        return found

    # -- once ------------------------------------------------------------------ #

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.call_each("bind_kv_cache_manager", kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.call_each("bind_gpu_block_pool", gpu_block_pool)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.call_each("set_xfer_handshake_metadata", metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self.call_each("set_xfer_handshake_metadata_pp_aware", metadata)

    def get_finished_count(self) -> int | None:
        counts = [c for _, c in self.results("get_finished_count")]
        if not counts or any(c is None for c in counts):
            return None
        if len(set(counts)) > 1:
            raise ValueError(f"nodes returned incompatible finished counts: {sorted(set(counts))}")
        return counts[0]

    # -- per request: its load (LoadPlanning), its blocks once finished (BlockHolding) -- #

    def on_new_request(self, request: Any) -> None:
        self.call_each("on_new_request", self.views.of(request))
