"""A vLLM KV connector that does nothing, for measuring dispatch overhead.

Loaded by vLLM's factory through ``kv_connector_module_path = "benchmarks.noop_connector"``
(MultiConnector children and KV Composer ``vllm`` nodes alike), so both sides
of a comparison call the very same class.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
)


class NoopConnector(KVConnectorBase_V1):
    """Implements the abstract methods as no-ops; inherits vLLM's defaults for the rest."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class NoopFullConnector(NoopConnector):
    """Also overrides every optional per-step method (with what vLLM's defaults do).

    KV Composer leaves a native connector out of a hook's calls when it keeps
    vLLM's do-nothing default; this class keeps none, so every hook is
    dispatched on both sides: the pure cost of dispatch.
    """

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        return None

    def finish_forward(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return KVConnectorTransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_kv_connector_stats(self) -> Any:
        return None

    def get_kv_connector_kv_cache_events(self) -> Any:
        return None

    def build_connector_worker_meta(self) -> Any:
        return None

    def on_new_request(self, request: Any) -> None:
        return None

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def take_events(self) -> Iterable[Any]:
        return ()

    def has_pending_block_frees(self) -> bool:
        return False

    def has_pending_push_work(self) -> bool:
        return False
