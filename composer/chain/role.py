"""Chosen by role: the chain of one vLLM process, as vLLM's own connectors hold a
scheduler object or a worker object (:func:`chain_for`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from composer.chain.metadata import ChainMetadata, ChainWorkerMetadata, TransferResults
from composer.chain.scheduler import SchedulerChain
from composer.chain.worker import WorkerChain
from composer.pipeline import ResolvedPipeline
from composer.plugin_types import VllmProcess


def chain_for(
    pipeline: ResolvedPipeline,
    process: VllmProcess,
    *,
    vllm_config: Any = None,
    kv_cache_config: Any = None,
    stats_type: Callable[..., Any] | None = None,
    metadata_type: type[ChainMetadata] = ChainMetadata,
    restore_worker_meta: bool = False,
    worker_metadata_type: type[ChainWorkerMetadata] = ChainWorkerMetadata,
    transfer_results_type: Callable[[], Any] = TransferResults,
) -> SchedulerChain | WorkerChain:
    """The chain of ``pipeline`` in ``process``: a :class:`SchedulerChain` or a
    :class:`WorkerChain`. Each takes the arguments of its own process (its
    ``__init__`` says what they are); those of the other process are dropped, so
    the vLLM adapter passes the same ones in both."""
    common = {
        "vllm_config": vllm_config,
        "kv_cache_config": kv_cache_config,
        "stats_type": stats_type,
    }
    if process == "scheduler":
        return SchedulerChain(
            pipeline,
            metadata_type=metadata_type,
            restore_worker_meta=restore_worker_meta,
            **common,
        )
    if process == "worker":
        return WorkerChain(
            pipeline,
            worker_metadata_type=worker_metadata_type,
            transfer_results_type=transfer_results_type,
            **common,
        )
    raise ValueError(f"no vLLM process {process!r}: 'scheduler' or 'worker'")
