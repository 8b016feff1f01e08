"""Build :class:`~composer.kv_caches.CanonicalKVCaches` from vLLM's KV cache tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from composer.kv_caches import CanonicalKVCaches, KVGroup, KVRegion


def _group_kind(spec: Any) -> str:
    name = type(spec).__name__
    for suffix, kind in (
        ("SlidingWindowSpec", "sliding_window"),
        ("ChunkedLocalAttentionSpec", "chunked_local"),
        ("MambaSpec", "mamba"),
        ("AttentionSpec", "attention"),
    ):
        if name.endswith(suffix):
            return kind
    return name


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole backing storage of ``t`` as a flat int8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.int8, device=t.device).set_(t.untyped_storage())


class _Regions:
    """Regions as found, one per distinct view; aliasing views (overlaid groups) are one."""

    def __init__(self) -> None:
        self.regions: list[KVRegion] = []
        self.seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], int] = {}
        #: Layer name -> indexes of the regions holding it.
        self.of_layer: dict[str, list[int]] = {}

    def add(self, view: torch.Tensor, layers: tuple[str, ...]) -> None:
        key = (view.data_ptr(), tuple(view.shape), tuple(view.stride()))
        if key in self.seen:
            index = self.seen[key]
            merged = tuple(dict.fromkeys(self.regions[index].layers + layers))
            self.regions[index] = KVRegion(self.regions[index].tensor, merged)
        else:
            index = self.seen[key] = len(self.regions)
            self.regions.append(KVRegion(view, layers))
        for layer in layers:
            indexes = self.of_layer.setdefault(layer, [])
            if index not in indexes:
                indexes.append(index)


def build(kv_caches: dict[str, torch.Tensor], kv_cache_config: Any) -> CanonicalKVCaches:
    num_blocks = int(kv_cache_config.num_blocks)
    found = _Regions()
    page_of = _page_sizes(kv_cache_config)
    for spec in kv_cache_config.kv_cache_tensors:
        for view, layers in _views(spec, kv_caches, num_blocks, page_of):
            found.add(view, layers)
    for name, tensor in kv_caches.items():
        if name not in found.of_layer:  # layers vLLM did not describe: take them as they are
            found.add(_rows(tensor, num_blocks), (name,))
    groups = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        ids = sorted({i for layer in group.layer_names for i in found.of_layer.get(layer, [])})
        groups.append(
            KVGroup(
                group_id=gid,
                kind=_group_kind(spec),
                block_size=int(getattr(spec, "block_size", 0)),
                layer_names=tuple(group.layer_names),
                region_ids=tuple(ids),
            )
        )
    return CanonicalKVCaches(
        num_blocks=num_blocks, regions=tuple(found.regions), groups=tuple(groups)
    )


def _views(
    spec: Any, kv_caches: dict[str, torch.Tensor], num_blocks: int, page_of: dict[str, int]
) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
    """(block-major view, its layers) of one of vLLM's KV cache tensors."""
    layers = [name for name in getattr(spec, "layers", None) or getattr(spec, "shared_by", [])]
    present = [name for name in layers if name in kv_caches]
    if not present:
        return []
    block_stride = getattr(spec, "block_stride", None)
    layer_stride = getattr(spec, "layer_stride", None)
    if block_stride is None or layer_stride is None:
        # Older vLLM: one tensor per layer, block-major.
        return [(_rows(kv_caches[name], num_blocks), (name,)) for name in present]
    first = kv_caches[present[0]]
    flat = _storage_bytes(first)
    base = first.data_ptr() - flat.data_ptr() - layers.index(present[0]) * layer_stride
    page = page_of.get(present[0]) or _row_bytes(first)
    if len(layers) * page <= block_stride and layer_stride == page:
        # Block-outermost: a block is one row holding every layer's page.
        rows = flat.as_strided((num_blocks, len(layers) * page), (block_stride, 1), base)
        return [(rows, tuple(layers))]
    return [
        (flat.as_strided((num_blocks, page), (block_stride, 1), base + i * layer_stride), (name,))
        for i, name in enumerate(layers)
        if name in kv_caches
    ]


def _page_sizes(kv_cache_config: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        page = getattr(group.kv_cache_spec, "page_size_bytes", None)
        if page:
            for layer in group.layer_names:
                out[layer] = int(page)
    return out


def _row_bytes(t: torch.Tensor) -> int:
    return int(t[0].numel() * t.element_size())


def _rows(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A block-major tensor as int8 ``[num_blocks, bytes]`` (no copy)."""
    if t.shape[0] != num_blocks:
        raise ValueError(
            f"KV cache tensor of shape {tuple(t.shape)} is not block-major over {num_blocks} blocks"
        )
    flat = _storage_bytes(t)
    offset = t.data_ptr() - flat.data_ptr()
    return flat.as_strided((num_blocks, _row_bytes(t)), (t.stride(0) * t.element_size(), 1), offset)


@contextlib.contextmanager
def refuse_moves(kv_caches: dict[str, torch.Tensor]) -> Iterator[None]:
    """Raise if the body moves vLLM's KV tensors: a node that re-homes them (into
    shared memory, say) leaves every other node's canonical view pointing at
    memory vLLM no longer uses."""
    before = {name: t.data_ptr() for name, t in kv_caches.items()}
    yield
    moved = sorted(name for name, t in kv_caches.items() if t.data_ptr() != before[name])
    if moved:
        raise RuntimeError(
            f"a node moved vLLM's KV cache tensors during register_kv_caches "
            f"({len(moved)} layers, e.g. {moved[0]}); the canonical view handed to the "
            "other nodes would read and write stale memory. Configure that node not to "
            "relocate vLLM's KV cache."
        )
