"""A request's load as ranges of tokens, one per node serving it: what the chain plans
(:mod:`composer.chain.loads`), sends its workers with each step's metadata, and a
node sees in ``request.loads``. One type from the lookup to what arrived."""

from __future__ import annotations

from dataclasses import dataclass, field

from composer.kv_caches import NULL_BLOCK


@dataclass(slots=True)
class Range:
    """One node's part of a request's load, from the plan to what arrived of it.

    The lookup plans it (``node``, ``start``, ``tokens``, ``load_async``); when vLLM
    allocates the request's blocks it gets the ``blocks`` its load writes and
    travels so to the workers (``ChainMetadata.async_loads``) and to the nodes
    (``request.loads``); what vLLM reports back settles ``delivered``.

    vLLM reports a load's failure back to the scheduler: a sync load's (and an
    async one's) failed blocks as ``invalid_block_ids``, and it recomputes from
    the first of them on; an async load that failed as a whole (several KV
    cache groups, or a node switched off) in ``failed_recving``. Every failure
    path of the chain ends there (a node's fault, its store away, a checksum
    refusal, a switch-off: their blocks are load errors)."""

    node: str
    #: The computed tokens before this range (vLLM's, or the previous ranges' end).
    start: int
    tokens: int
    #: The node's own answer: it loads asynchronously.
    load_async: bool = False
    #: Per KV cache group, the blocks the load writes, in order (from block
    #: ``start // block_size``; null blocks of a sliding window included).
    blocks: tuple[tuple[int, ...], ...] = ()
    #: A sync load the chain made async for vLLM (several groups, or ranges of
    #: both kinds): the chain reports it done once ``start_load_kv`` ran.
    reported_by_chain: bool = False
    #: Tokens that arrived: the planned ones until a failure is reported.
    delivered: int = field(init=False)

    def __post_init__(self) -> None:
        self.delivered = self.tokens

    def block_ids(self) -> frozenset[int]:
        """The blocks the load writes, in any group (never the null block)."""
        return frozenset(b for group in self.blocks for b in group if b != NULL_BLOCK)

    def failed(self, invalid: set[int], block_size: int) -> None:
        """``invalid`` blocks failed: vLLM recomputes from the first the load wrote."""
        first = self.start // block_size if block_size else 0
        for group in self.blocks:
            for i, block in enumerate(group):
                if block != NULL_BLOCK and block in invalid:
                    kept = max(0, (first + i) * block_size - self.start)
                    self.delivered = min(self.delivered, kept)
                    break

    def cut(self, position: int) -> None:
        """vLLM recomputes from token ``position`` on (an earlier range failed there)."""
        self.delivered = min(self.delivered, max(0, position - self.start))
