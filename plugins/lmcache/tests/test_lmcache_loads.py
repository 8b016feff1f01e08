"""The lmcache node's count of loaded tokens, on LMCache's own metadata classes."""

from __future__ import annotations

import pytest
from kvc_lmcache.loads import LoadCounter
from lmcache.integration.vllm.lmcache_mp_metadata import (
    LMCacheMPConnectorMetadata,
    LMCacheMPRequestMetadata,
)
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

BLOCK = 32


def metadata(*ops: tuple[str, str, LoadStoreOp]) -> LMCacheMPConnectorMetadata:
    meta = LMCacheMPConnectorMetadata()
    for req_id, direction, op in ops:
        meta.add_request_metadata(LMCacheMPRequestMetadata(req_id, direction, op))
    return meta


def retrieve(blocks: list[list[int]] | list[int], start: int = 0, skip: int = 0) -> LoadStoreOp:
    first = blocks[0]
    n = len(first) if isinstance(first, list) else len(blocks)
    end = start + n * BLOCK
    return LoadStoreOp(list(range(end)), blocks, start, end, skip)


def test_a_finished_retrieve_counts_its_tokens_once() -> None:
    loads = LoadCounter()
    loads.started(metadata(("a", "RETRIEVE", retrieve([[4, 5, 6]]))))
    assert loads.settle(set()) == 0  # not finished yet
    loads.transfers_done({"a"})
    assert loads.settle(set()) == 3 * BLOCK
    loads.transfers_done({"a"})
    assert loads.settle(set()) == 0


def test_stores_are_not_loads() -> None:
    loads = LoadCounter()
    loads.started(metadata(("a", "STORE", retrieve([[4, 5]]))))
    loads.transfers_done({"a"})
    assert loads.settle(set()) == 0


def test_tokens_vllms_prefix_cache_holds_are_not_written_so_not_counted() -> None:
    loads = LoadCounter()
    # A 64-token chunk starting at 0; vLLM already holds the first 32.
    loads.started(metadata(("a", "RETRIEVE", retrieve([[4, 5, 6, 7]], skip=BLOCK))))
    loads.transfers_done({"a"})
    assert loads.settle(set()) == 3 * BLOCK


@pytest.mark.parametrize(
    ("failed", "loaded"),
    # Blocks 5 and 6 are written; block 4 is vLLM's own (skipped), its failure costs
    # nothing; vLLM recomputes from the first failed block on (6 after 5 is lost too).
    [(set(), 64), ({5}, 0), ({6}, 32), ({4, 6}, 32), ({4, 5, 6}, 0), ({99}, 64), ({4}, 64)],
)
def test_failed_blocks_are_not_counted(failed: set[int], loaded: int) -> None:
    loads = LoadCounter()
    loads.started(metadata(("a", "RETRIEVE", retrieve([[4, 5, 6]], skip=BLOCK))))
    loads.transfers_done({"a"})
    assert loads.settle(failed) == loaded


def test_several_groups_lose_everything_from_the_first_failed_span() -> None:
    loads = LoadCounter()
    # Two KV cache groups over the same 96 tokens: a full-attention group with
    # 32-token blocks, a second group with one 96-token block.
    op = LoadStoreOp(list(range(96)), [[1, 2, 3], [9]], 0, 96, 0)
    loads.started(metadata(("a", "RETRIEVE", op)))
    loads.transfers_done({"a"})
    assert loads.settle({2}) == 32
    loads.started(metadata(("b", "RETRIEVE", op)))
    loads.transfers_done({"b"})
    assert loads.settle({2, 9}) == 0  # the second group's one block covers everything


def test_flattened_block_ids_are_one_group() -> None:
    loads = LoadCounter()
    loads.started(metadata(("a", "RETRIEVE", retrieve([4, 5]))))
    loads.transfers_done({"a"})
    assert loads.settle({5}) == BLOCK


def test_a_request_that_failed_as_a_whole_counts_nothing() -> None:
    loads = LoadCounter()
    loads.started(
        metadata(("a", "RETRIEVE", retrieve([[4, 5]])), ("b", "RETRIEVE", retrieve([[7]])))
    )
    loads.transfers_done({"a", "b"}, failed={"a"})
    assert loads.settle(set()) == BLOCK


def test_a_finished_request_with_no_result_is_forgotten() -> None:
    loads = LoadCounter()
    loads.started(metadata(("a", "RETRIEVE", retrieve([[4]])), ("b", "RETRIEVE", retrieve([[5]]))))
    loads.transfers_done({"b"})
    loads.forget({"a", "b"})  # b's result came in this step: still counted
    assert loads.settle(set()) == BLOCK
    assert not loads.pending
