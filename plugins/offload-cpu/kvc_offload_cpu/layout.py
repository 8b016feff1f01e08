"""What one KV block costs to store, read from vLLM's ``KVCacheConfig`` (no torch).

The scheduler half sizes its slot index from this; the worker half checks it
against the canonical view (``CanonicalKVCaches``) it actually copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BlockLayout:
    block_size: int  # tokens per block
    slot_bytes: int  # bytes of one block across every layer (all groups)
    num_groups: int
    group_kinds: tuple[str, ...]


def layout_from_kv_cache_config(kv_cache_config: Any) -> BlockLayout:
    """Tokens per block and bytes per block of vLLM's ``KVCacheConfig``.

    Bytes per block = for every ``KVCacheTensor``, ``len(layers)`` pages of the
    group owning those layers (``kv_cache_spec.page_size_bytes``) — the bytes
    of row ``b`` of every canonical region.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("KVCacheConfig has no KV cache groups")
    page_of: dict[str, int] = {}
    kinds: list[str] = []
    block_sizes = set()
    for group in groups:
        spec = group.kv_cache_spec
        block_sizes.add(int(spec.block_size))
        kinds.append(_kind(spec))
        for name in group.layer_names:
            page_of[name] = int(spec.page_size_bytes)
    if len(block_sizes) != 1:
        raise ValueError(f"KV cache groups have different block sizes: {sorted(block_sizes)}")
    total = 0
    seen: set[str] = set()
    for tensor in kv_cache_config.kv_cache_tensors:
        names = getattr(tensor, "layers", None) or getattr(tensor, "shared_by", None) or ()
        for name in names:
            if name in page_of and name not in seen:
                seen.add(name)
                total += page_of[name]
    if total == 0:  # no tensor placement given: every layer of every group
        total = sum(page_of.values())
    return BlockLayout(
        block_size=block_sizes.pop(),
        slot_bytes=total,
        num_groups=len(groups),
        group_kinds=tuple(kinds),
    )


def _kind(spec: Any) -> str:
    name = type(spec).__name__
    # A FullAttentionSpec that records a sliding window keeps every block
    # (vLLM's non-hybrid manager), so only the class decides.
    if "SlidingWindow" in name or "ChunkedLocal" in name:
        return "sliding_window"
    if "Mamba" in name:
        return "mamba"
    if "Attention" in name:
        return "attention"
    return name
