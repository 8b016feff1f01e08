"""The canonical KV cache view over several real vLLM layouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

from composer.vllm.canonical import build
from composer.vllm.connector import ComposedConnector

BLOCKS, BS, HEADS, HEAD = 16, 4, 2, 8
SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
PAGE = SPEC.page_size_bytes  # bytes of one layer's block


def layer_view(storage: torch.Tensor, offset: int, block_stride: int) -> torch.Tensor:
    """A layer's tensor as vLLM's CPU backend shapes it: [blocks, heads, block_size, 2*head]."""
    flat = storage.view(torch.bfloat16)
    strides = (block_stride // 2, BS * 2 * HEAD, 2 * HEAD, 1)
    return flat.as_strided((BLOCKS, HEADS, BS, 2 * HEAD), strides, offset // 2)


def check_rows(canonical, kv_caches) -> None:  # type: ignore[no-untyped-def]
    for region in canonical.regions:
        for block in range(BLOCKS):
            row = region.tensor[block]
            pattern = torch.randint(-100, 100, row.shape, dtype=torch.int8)
            row.copy_(pattern)
            seen = b"".join(
                kv_caches[layer][block].contiguous().view(torch.int8).flatten().numpy().tobytes()
                for layer in region.layers
            )
            assert seen == pattern.numpy().tobytes()


def config(tensors: list[KVCacheTensor], groups: list[KVCacheGroupSpec]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups)


def cpu_backend_layout() -> tuple[dict[str, torch.Tensor], KVCacheConfig]:
    """Two layers, each its own region of one allocation (layer-outermost), as on CPU."""
    layers = ["l0", "l1"]
    storage = torch.zeros(2 * BLOCKS * PAGE, dtype=torch.int8)
    kv = {name: layer_view(storage, i * BLOCKS * PAGE, PAGE) for i, name in enumerate(layers)}
    tensor = KVCacheTensor(
        size=storage.numel(), layers=layers, layer_stride=BLOCKS * PAGE, block_stride=PAGE
    )
    return kv, config([tensor], [KVCacheGroupSpec(layers, SPEC)])


def test_layer_outermost_layout_of_the_cpu_backend() -> None:
    kv, cfg = cpu_backend_layout()
    canonical = build(kv, cfg)
    assert [r.layers for r in canonical.regions] == [("l0",), ("l1",)]
    assert canonical.bytes_per_block == 2 * PAGE
    assert canonical.groups[0].kind == "attention" and canonical.groups[0].region_ids == (0, 1)
    check_rows(canonical, kv)


def test_block_outermost_layout_is_one_region_per_allocation() -> None:
    layers = ["l0", "l1", "l2"]
    storage = torch.zeros(3 * BLOCKS * PAGE, dtype=torch.int8)
    kv = {name: layer_view(storage, i * PAGE, 3 * PAGE) for i, name in enumerate(layers)}
    cfg = config(
        [
            KVCacheTensor(
                size=storage.numel(), layers=layers, layer_stride=PAGE, block_stride=3 * PAGE
            )
        ],
        [KVCacheGroupSpec(layers, SPEC)],
    )
    canonical = build(kv, cfg)
    assert len(canonical.regions) == 1 and canonical.regions[0].layers == tuple(layers)
    assert canonical.bytes_per_block == 3 * PAGE
    check_rows(canonical, kv)


def test_layers_sharing_a_tensor_are_listed_once() -> None:
    # Cross-layer KV sharing: l2 reuses l0's cache; vLLM describes only l0.
    storage = torch.zeros(2 * BLOCKS * PAGE, dtype=torch.int8)
    kv = {"l0": layer_view(storage, 0, PAGE), "l1": layer_view(storage, BLOCKS * PAGE, PAGE)}
    kv["l2"] = kv["l0"]
    cfg = config(
        [
            KVCacheTensor(
                size=storage.numel(),
                layers=["l0", "l1"],
                layer_stride=BLOCKS * PAGE,
                block_stride=PAGE,
            )
        ],
        [KVCacheGroupSpec(["l0", "l1", "l2"], SPEC)],
    )
    canonical = build(kv, cfg)
    assert [r.layers for r in canonical.regions] == [("l0", "l2"), ("l1",)]
    assert canonical.bytes_per_block == 2 * PAGE


def test_hybrid_groups_each_reference_their_regions() -> None:
    window = SlidingWindowSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16, sliding_window=8
    )
    storage = torch.zeros(2 * BLOCKS * PAGE, dtype=torch.int8)
    kv = {"full": layer_view(storage, 0, PAGE), "swa": layer_view(storage, BLOCKS * PAGE, PAGE)}
    cfg = config(
        [
            KVCacheTensor(
                size=BLOCKS * PAGE, layers=["full"], layer_stride=BLOCKS * PAGE, block_stride=PAGE
            ),
            KVCacheTensor(
                size=BLOCKS * PAGE,
                layers=["swa"],
                layer_stride=BLOCKS * PAGE,
                block_stride=PAGE,
                offset=BLOCKS * PAGE,
            ),
        ],
        [KVCacheGroupSpec(["full"], SPEC), KVCacheGroupSpec(["swa"], window)],
    )
    canonical = build(kv, cfg)
    assert [(g.kind, g.region_ids) for g in canonical.groups] == [
        ("attention", (0,)),
        ("sliding_window", (1,)),
    ]
    assert canonical.regions[1].layers == ("swa",)  # group 1's one region
    check_rows(canonical, kv)


def test_a_node_that_moves_vllm_tensors_is_refused() -> None:
    """The composed connector refuses a node that re-homes vLLM's KV tensors."""
    kv, cfg = cpu_backend_layout()

    def relocate(canonical: object, raw: dict[str, torch.Tensor]) -> None:
        raw["l1"].set_(raw["l1"].clone())  # what LMCache's lmcache_driven mode does

    connector = object.__new__(ComposedConnector)
    connector._kv_cache_config = cfg
    connector.worker = SimpleNamespace(register_kv_caches=relocate)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="moved vLLM's KV cache tensors"):
        connector.register_kv_caches(kv)
