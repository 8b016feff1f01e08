"""The workers' output on the scheduler side: ``update_connector_output``.

Each node gets its own worker metadata (the entry its worker half built), and
inside vLLM also finds it in ``connector_output.kv_connector_worker_meta`` during
its call, as MultiConnector's children do. A node switched off in a worker is
switched off here first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from composer.chain.base import ChainBase
from composer.chain.metadata import ChainWorkerMetadata


class WorkerOutput(ChainBase):
    def _bind_worker_output(self) -> None:
        calls = [
            (node_id, fn, "connector_output" in names, "worker_meta" in names)
            for node_id, fn, names in self.lists.own["update_connector_output"]
        ]
        if not calls:
            # (With nothing called, nothing is overwritten either.)
            self.update_connector_output = self._follow_workers  # (its bool is ignored)
        elif self.restore_worker_meta and all(out and not meta for _, _, out, meta in calls):
            self.update_connector_output = self._make_native_only(
                [(node_id, fn) for node_id, fn, _, _ in calls]
            )
        else:
            self.update_connector_output = self._make_update(calls)

    def _follow_workers(self, connector_output: Any) -> bool:
        """Switch off here what a worker switched off; True if anything was."""
        chain_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        gone = getattr(chain_meta, "disabled", None)
        if not gone or gone <= self.disabled:
            return False
        for node_id in sorted(gone - self.disabled):
            self.switch_off(node_id, "switched off in a worker")
        return True

    def _make_native_only(self, calls: list[tuple[str, Any]]) -> Callable[[Any], None]:
        # Only native nodes (the usual case for vLLM's own connectors): the loop
        # MultiConnector runs, with no per-node argument choice.
        fault, follow_workers = self.fault, self._follow_workers

        def update_native_only(connector_output: Any) -> None:
            chain_meta = connector_output.kv_connector_worker_meta
            if chain_meta is None:  # no worker metadata this step: nothing to swap
                for node_id, fn in calls:
                    try:
                        fn(connector_output)
                    except Exception as exc:
                        fault(node_id, "update_connector_output", exc)
                return
            # (Inline: a call per step costs more than this check.)
            if chain_meta is not None and chain_meta.disabled and follow_workers(connector_output):
                self.update_connector_output(connector_output)  # re-bound
                return
            per_node = getattr(chain_meta, "per_node", None)
            try:
                for node_id, fn in calls:
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

    def _make_update(self, calls: list[tuple[str, Any, bool, bool]]) -> Callable[[Any], None]:
        fault, swap = self.fault, self.restore_worker_meta

        def update_connector_output(connector_output: Any) -> None:
            if self._follow_workers(connector_output):
                self.update_connector_output(connector_output)  # re-bound
                return
            chain_meta = getattr(connector_output, "kv_connector_worker_meta", None)
            per_node = chain_meta.per_node if isinstance(chain_meta, ChainWorkerMetadata) else {}
            try:
                for node_id, fn, takes_output, takes_meta in calls:
                    meta = per_node.get(node_id)
                    if swap:
                        connector_output.kv_connector_worker_meta = meta
                    try:
                        _call_with(fn, takes_output, takes_meta, connector_output, meta)
                    except Exception as exc:
                        fault(node_id, "update_connector_output", exc)
            finally:
                if swap:
                    connector_output.kv_connector_worker_meta = chain_meta

        return update_connector_output


def _call_with(fn: Any, takes_output: bool, takes_meta: bool, output: Any, meta: Any) -> None:
    """Call ``fn`` with the arguments its hookimpl names."""
    if takes_output and takes_meta:
        fn(output, meta)
    elif takes_output:
        fn(output)
    elif takes_meta:
        fn(meta)
    else:
        fn()
