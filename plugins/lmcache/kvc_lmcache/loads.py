"""How many tokens LMCache loaded into vLLM's KV cache: its connector keeps no count.

A retrieve is announced in the step's connector metadata (LMCache's
``LMCacheMPRequestMetadata``, direction ``RETRIEVE``: a token range and, per KV
cache group, the block ids it writes). vLLM then asks, in one later step, which
loads finished (``get_transfer_results``) and right after which blocks failed
(``get_block_ids_with_load_errors``). A finished retrieve is counted once that
step's failed blocks are known, up to the first failed block (vLLM recomputes
from there); a request that failed as a whole counts nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Retrieve:
    start: int  # first token LMCache writes (after the ones vLLM's prefix cache holds)
    end: int
    range_start: int  # where the op's block ids begin
    groups: list[list[int]]  # block ids per KV cache group


def _groups(block_ids: Any) -> list[list[int]]:
    """Per-group block ids; LMCache also meets them flattened (one group)."""
    if not block_ids:
        return []
    if isinstance(block_ids[0], int):
        return [list(block_ids)]
    return [list(g) for g in block_ids]


def _failed_tokens(r: _Retrieve, errors: set[int]) -> int:
    """Tokens of the written range vLLM recomputes: from the first one in a failed
    block of any group on (vLLM truncates a request's computed tokens there)."""
    first = r.end
    for ids in r.groups:
        if not ids:
            continue
        per_block = (r.end - r.range_start) // len(ids)
        for i, block in enumerate(ids):
            if block in errors:
                lo = max(r.start, r.range_start + i * per_block)
                hi = min(r.end, r.range_start + (i + 1) * per_block)
                if hi > lo:  # (else a block vLLM's prefix cache holds: not written)
                    first = min(first, lo)
                    break
    return r.end - first


@dataclass
class LoadCounter:
    pending: dict[str, _Retrieve] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)

    def started(self, metadata: Any) -> None:
        """Note the retrieves of a step's metadata (LMCache's connector metadata)."""
        for meta in getattr(metadata, "requests", ()):
            if getattr(meta, "direction", None) != "RETRIEVE":
                continue
            op = meta.op
            self.pending[meta.request_id] = _Retrieve(
                start=op.start + op.skip_first_n_tokens,
                end=op.end,
                range_start=op.start,
                groups=_groups(op.block_ids),
            )

    def transfers_done(self, recving: Iterable[str], failed: Iterable[str] = ()) -> None:
        """The step's finished loads; the ``failed`` ones loaded nothing usable."""
        for req_id in failed:
            self.pending.pop(req_id, None)
        self.finished.extend(r for r in recving if r in self.pending)

    def settle(self, errors: set[int]) -> int:
        """Tokens loaded by the loads finished this step, given its failed blocks."""
        loaded = 0
        for req_id in self.finished:
            r = self.pending.pop(req_id, None)
            if r is not None:
                loaded += max(0, r.end - r.start - _failed_tokens(r, errors))
        self.finished = []
        return loaded

    def forget(self, req_ids: Iterable[str]) -> None:
        """Requests vLLM finished: a load of theirs still pending is not coming."""
        for req_id in req_ids:
            if req_id not in self.finished:
                self.pending.pop(req_id, None)
