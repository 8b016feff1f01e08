"""What crosses between the chain's two halves, and what it hands back to vLLM.

The scheduler half sends :class:`ChainMetadata` to the workers each step; the
workers answer with :class:`ChainWorkerMetadata`. The vLLM adapter subclasses
both (and passes vLLM's own transfer-results class), so nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer.ranges import Range


class TransferParamsClash(RuntimeError):
    """Two nodes wrote the same ``kv_transfer_params`` key for one request."""


@dataclass
class ChainMetadata:
    """What the scheduler half sends the worker half each step."""

    per_node: dict[str, Any] = field(default_factory=dict)
    #: Finished request id -> the nodes holding its blocks for a save; vLLM frees
    #: them when the last one has finished (MultiConnector's rule).
    holds: dict[str, tuple[str, ...]] | None = None
    #: Node id -> block ids it loads this step, so a failing load becomes load errors.
    loads: dict[str, set[int]] = field(default_factory=dict)
    #: Request id -> what starts loading asynchronously (for vLLM) this step: its
    #: ranges (each with the blocks it loads, and whether the chain made the node's
    #: sync load async for vLLM and reports it done). The request is done when every
    #: range is, and failed if one failed (several KV cache groups: if a block failed).
    async_loads: dict[str, tuple[Range, ...]] | None = None
    #: Nodes switched off in the scheduler: the worker halves follow.
    disabled: frozenset[str] = frozenset()


@dataclass
class ChainWorkerMetadata:
    """What the worker halves send back; one entry per node that returned something."""

    per_node: dict[str, Any] = field(default_factory=dict)
    #: Nodes switched off in a worker: the scheduler half follows.
    disabled: frozenset[str] = frozenset()

    def aggregate(self, other: ChainWorkerMetadata) -> ChainWorkerMetadata:
        merged = dict(self.per_node)
        for node_id, meta in other.per_node.items():
            mine = merged.get(node_id)
            merged[node_id] = meta if mine is None else mine.aggregate(meta)
        return type(self)(merged, self.disabled | other.disabled)


@dataclass
class TransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
