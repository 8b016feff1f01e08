"""Scheduler side: each step's metadata, the once-only bindings, and the two jobs of a
request's life, planning its load (:mod:`.loads`) and holding its blocks when it
finishes (:mod:`.holds`).
"""

from __future__ import annotations

from typing import Any

from composer.chain.calls import Call, adapt
from composer.chain.holds import BlockHolding
from composer.chain.loads import LoadPlanning
from composer.chain.metadata import ChainMetadata
from composer.views import RequestView, StepView


class SchedulerSide(LoadPlanning, BlockHolding):
    """The scheduler half's hooks: each a method looping over its call list."""

    #: ``build_connector_meta``'s calls: with the step view and vLLM's output when
    #: some node names the step view, else with what each hookimpl names.
    meta_calls: list[tuple[str, Call]]
    meta_wants_step: bool

    def _bind_scheduler(self) -> None:
        if "step" in self.lists.wanted["build_connector_meta"]:
            self.meta_wants_step, self.meta_calls = True, self.calls["build_connector_meta"]
        else:
            # No node names it: none is built (a view per step costs).
            self.meta_wants_step = False
            self.meta_calls = [
                (node_id, adapt(fn, argnames, ("scheduler_output",)))
                for node_id, fn, argnames in self.lists.own["build_connector_meta"]
            ]

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
        meta = self.metadata_type(per_node, None, self.pending_loads)
        self.pending_loads = {}
        if self.new_holds or self.new_async_loads or self.disabled:
            self._step_decisions(meta)
        return meta

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

    def _step_decisions(self, meta: ChainMetadata) -> None:
        """What the workers must follow this step: holds, async loads, switch-offs."""
        if self.new_holds:
            meta.holds, self.new_holds = self.new_holds, {}
        if self.new_async_loads:
            meta.async_loads, self.new_async_loads = self.new_async_loads, {}
        if self.disabled:
            meta.disabled = frozenset(self.disabled)

    # -- once ------------------------------------------------------------------ #

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.call_each("bind_kv_cache_manager", kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.call_each("bind_gpu_block_pool", gpu_block_pool)

    # -- per request ------------------------------------------------------------ #

    def on_new_request(self, request: Any) -> None:
        self.call_each("on_new_request", RequestView(request))

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
