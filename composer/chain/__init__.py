"""The runtime: a pipeline's nodes in one vLLM process, dispatched with MultiConnector
semantics: :func:`chain_for` gives the process's chain. Start at :mod:`.core`; its
docstring maps the modules."""

from composer.chain.core import ChainCore
from composer.chain.metadata import (
    ChainMetadata,
    ChainWorkerMetadata,
    TransferParamsClash,
    TransferResults,
)
from composer.chain.role import chain_for
from composer.chain.scheduler import SchedulerChain
from composer.chain.worker import WorkerChain
from composer.plugin_types import VllmProcess

__all__ = [
    "ChainCore",
    "ChainMetadata",
    "ChainWorkerMetadata",
    "SchedulerChain",
    "TransferParamsClash",
    "TransferResults",
    "VllmProcess",
    "WorkerChain",
    "chain_for",
]
