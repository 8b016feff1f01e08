"""What a tier model is to the simulator (:class:`TierModel`), the model of vLLM's own
prefix cache, and the KV cache groups every model is given (:class:`SimKVGroup`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from composer.controls import Retention

DEFAULT_BLOCK_SIZE = 32
#: The row of vLLM's own prefix cache (not a valid node id, so it cannot clash with one).
VLLM_CACHE_ID = "<vllm>"


class SimulateError(Exception):
    """A usage problem of ``kvc simulate`` (bad option value)."""


@dataclass(frozen=True)
class SimKVGroup:
    """One KV cache group, as a tier model sees it (one group of every layer by default).

    Not :class:`composer.kv_caches.KVGroup`, a running worker's view of vLLM's tensors.
    """

    #: "attention", "sliding_window", "chunked_local" or "mamba".
    kind: str
    #: Bytes of one block of this group (all its layers); 0 for mamba.
    block_bytes: int
    #: Tokens of the sliding window or the attention chunk; 0 for none.
    window: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "block_bytes": self.block_bytes, "window": self.window}


@dataclass(frozen=True)
class SimRequest:
    """What a tier model is told of the request it is about to see (``TierModel.arrive``)."""

    #: Whose request it is (vLLM's ``cache_salt``; "": none).
    tenant: str = ""
    #: Its ``kv_retention`` (None: it asks nothing).
    retention: Retention | None = None
    #: Its arrival, seconds on the trace's clock (a retention policy's ``now``).
    now: float = 0.0


# --------------------------------------------------------------------------- #
# models
# --------------------------------------------------------------------------- #


class TierModel(Protocol):
    """What a plugin's simulation model provides (``PluginType.simulator``).

    Built as ``Model(config, block_size=..., bytes_per_block=..., groups=...)``:
    tokens and bytes of one slot (one replay unit; with several groups, one
    group's block), and the model's KV cache groups (block bytes per unit).

    A replay in units of several vLLM blocks (whole trace blocks) ends every hit
    at a unit's end. A model whose class sets ``window_units = True`` is then
    also given ``unit_blocks`` (vLLM blocks a unit) when a group has a window: it
    keeps a window's own blocks (a 64-token window needs 2 blocks of a unit's
    16), and counts its capacity, evictions and the slots ``save`` returns in
    vLLM blocks. Any window then replays in units; a model without it, only
    windows of whole trace blocks (others every block, as ``--exact``).

    A model with cache policies may also give ``policies`` (each kind's policy in
    force, by kind) and ``policy_fallbacks`` (a dict per policy switched off because
    it raised: ``kind``, ``policy``, ``cls``, ``hook``, ``error``, ``fallback``,
    ``evictions``, ``in_force``): ``kvc simulate`` reports them, and fails under
    ``--strict`` when any policy was switched off.
    """

    @property
    def capacity_blocks(self) -> int:
        """Blocks the tier holds when full."""
        ...

    @property
    def evictions(self) -> int:
        """Blocks dropped to make room so far."""
        ...

    def arrive(self, request: SimRequest) -> None:
        """The next request's tenant, retention and time: what the calls until the next
        ``arrive`` are about (its lookup, load and save)."""
        ...

    def lookup(self, keys: Sequence[bytes], start: int, limit: int) -> int:
        """How many blocks from ``start`` (below ``limit``) it would serve now."""
        ...

    @property
    def bytes_loaded(self) -> int:
        """Bytes copied out so far."""
        ...

    @property
    def bytes_saved(self) -> int:
        """Bytes newly stored so far."""
        ...

    @property
    def window_saving(self) -> float | None:
        """Bytes it keeps of the requests' blocks over what a full-attention model of the
        same shape would keep; None when no group has a window."""
        ...

    @property
    def disabled_reason(self) -> str | None:
        """Why it serves nothing (as the real node says at start), or None."""
        ...

    def load(self, keys: Sequence[bytes], start: int, hit: int) -> None:
        """It serves blocks ``[start, start + hit)`` (touch them as the tier does at load)."""
        ...

    def save(
        self,
        keys: Sequence[bytes],
        prompt_tokens: int,
        computed: int,
        loaded: Sequence[tuple[int, int]] = (),
    ) -> int:
        """A finished request's full blocks (of ``prompt_tokens`` prompt tokens; vLLM
        had the first ``computed`` before computing it; ``loaded``: the block
        ranges ``[start, end)`` other nodes loaded into it); returns the slots it
        newly stored. Its retention (``arrive``) applies to its blocks from now."""
        ...


class PrefixCacheModel:
    """vLLM's own prefix cache: ``num_blocks`` blocks, least recently freed evicted first.

    vLLM frees a finished request's blocks last block first, so a request's
    tail is evicted before its head; the order of its free queue is kept here.
    """

    def __init__(self, num_blocks: int) -> None:
        self.capacity_blocks = num_blocks
        self.evictions = 0
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def lookup(self, keys: Sequence[bytes], start: int, limit: int) -> int:
        lru = self._lru
        hit = 0
        for k in range(start, limit):
            if keys[k] not in lru:
                break
            hit += 1
        return hit

    def finish(self, keys: Sequence[bytes]) -> None:
        if not self.capacity_blocks:
            return
        lru = self._lru
        for key in reversed(keys):
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
            self.evictions += 1
