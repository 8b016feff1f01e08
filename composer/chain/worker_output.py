"""The workers' output on the scheduler side: ``update_connector_output``.

Each node gets its own worker metadata (the entry its worker half built), and
inside vLLM also finds it in ``connector_output.kv_connector_worker_meta`` during
its call, as MultiConnector's children do. A node switched off in a worker is
switched off here first.
"""

from __future__ import annotations

from typing import Any

from composer.chain.base import ChainBase
from composer.chain.calls import Call


class WorkerOutput(ChainBase):
    #: (node id, callable taking (connector_output, worker_meta)), in node order.
    output_calls: list[tuple[str, Call]]
    #: Only native nodes, inside vLLM: their (node id, callable), for the loop
    #: MultiConnector runs (no argument choice); else None.
    output_native_only: list[tuple[str, Call]] | None

    def _bind_worker_output(self) -> None:
        self.output_calls = self.calls["update_connector_output"]
        own = self.lists.own["update_connector_output"]
        native_only = self.restore_worker_meta and all(
            names == ("connector_output",) for _, _, names in own
        )
        self.output_native_only = [(node_id, fn) for node_id, fn, _ in own] if native_only else None

    def update_connector_output(self, connector_output: Any) -> None:
        """Each node gets its own worker metadata (see the module's docstring)."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        failed = getattr(connector_output, "failed_recving", None)
        if (invalid or failed) and self.served:
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
            self._follow_workers(connector_output)  # (with nothing called, nothing overwritten)
            return None
        if getattr(chain_meta, "disabled", None) and self._follow_workers(connector_output):
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

    def _follow_workers(self, connector_output: Any) -> bool:
        """Switch off here what a worker switched off; True if anything was."""
        chain_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        gone = getattr(chain_meta, "disabled", None)
        if not gone or gone <= self.disabled:
            return False
        for node_id in sorted(gone - self.disabled):
            self.switch_off(node_id, "switched off in a worker")
        return True
