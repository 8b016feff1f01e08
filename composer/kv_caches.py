"""The canonical view of vLLM's KV caches, built once per worker for every node.

vLLM describes its KV cache allocation in ``KVCacheConfig.kv_cache_tensors``:
layer ``l``'s page for block ``b`` starts at ``offset + l * layer_stride +
b * block_stride`` bytes into a backing allocation. The canonical view turns
that into *regions*: int8 tensors ``[num_blocks, bytes_per_block]`` (strided
views, no copies) such that copying row ``b`` of every region copies block
``b`` whole. Block-outermost layouts (vLLM's CPU backend) give one region per
allocation whose row holds all layers' pages; layer-outermost layouts give one
region per layer. Layers that share a tensor are listed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: vLLM's null block (the block pool's first): positions a sliding window or a
#: chunk has left hold it; nothing is ever loaded into or saved from it.
NULL_BLOCK = 0


@dataclass(frozen=True)
class KVRegion:
    """Rows of one region hold one block each; ``layers`` are the layers whose pages it covers."""

    tensor: torch.Tensor  # int8 [num_blocks, bytes_per_block]
    layers: tuple[str, ...]

    @property
    def bytes_per_block(self) -> int:
        return int(self.tensor.shape[1])


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers, tokens per block, and the regions holding them."""

    group_id: int
    kind: str  # "attention", "sliding_window", "mamba", ...
    block_size: int
    layer_names: tuple[str, ...]
    region_ids: tuple[int, ...]


@dataclass(frozen=True)
class CanonicalKVCaches:
    num_blocks: int
    regions: tuple[KVRegion, ...]
    groups: tuple[KVGroup, ...]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across every region (what one block costs to store)."""
        return sum(r.bytes_per_block for r in self.regions)
