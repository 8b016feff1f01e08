"""``kvc simulate``'s model of an ``offload-cpu`` node.

It drives the tier's own :class:`~kvc_offload_cpu.index.BlockIndex` (the same
LRU, slot allocation and eviction) with the rules of the scheduler half
(:mod:`kvc_offload_cpu.scheduler`): slots = capacity // bytes of one block,
hits only of ready blocks and of at least ``min_blocks``, touch on load, and at
save a known block is touched, a new one allocated (evicting the least
recently used). Saves complete at once here: the replay runs one request at a
time, so no block is ever in flight or pinned.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.index import BlockIndex


class OffloadCPUModel:
    def __init__(self, config: BaseModel, *, block_size: int, bytes_per_block: int) -> None:
        assert isinstance(config, OffloadCPUConfig)
        self.config = config
        self.block_size = block_size
        self.capacity_blocks = int(config.capacity) // bytes_per_block if bytes_per_block else 0
        self.index = BlockIndex(self.capacity_blocks)

    @property
    def evictions(self) -> int:
        return self.index.evictions

    def lookup(self, keys: Sequence[bytes], start: int, limit: int) -> int:
        ready = self.index.ready
        hit = 0
        for k in range(start, min(limit, len(keys))):
            if ready(keys[k]) is None:
                break
            hit += 1
        return hit if hit >= self.config.min_blocks else 0

    def load(self, keys: Sequence[bytes]) -> None:
        index = self.index
        for key in keys:
            entry = index.ready(key)
            if entry is not None:
                index.touch(entry)

    def save(self, keys: Sequence[bytes], prompt_blocks: int) -> int:
        if not self.capacity_blocks:  # the real tier disables itself
            return 0
        index = self.index
        stop = prompt_blocks if self.config.save == "prompt" else len(keys)
        stored = 0
        for key in keys[:stop]:
            known = index.get(key)
            if known is not None:
                index.touch(known)
                continue
            entry = index.allocate(key)
            if entry is None:  # pragma: no cover - nothing is pinned in a replay
                break
            index.mark_ready(entry)
            stored += 1
        return stored
