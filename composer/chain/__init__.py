"""The runtime: a pipeline's nodes in one vLLM process, dispatched with MultiConnector
semantics. Start at :mod:`.core`; its docstring maps the modules."""

from composer.chain.base import VllmProcess
from composer.chain.core import Chain
from composer.chain.metadata import (
    ChainMetadata,
    ChainWorkerMetadata,
    TransferParamsClash,
    TransferResults,
)

__all__ = [
    "Chain",
    "ChainMetadata",
    "ChainWorkerMetadata",
    "TransferParamsClash",
    "TransferResults",
    "VllmProcess",
]
