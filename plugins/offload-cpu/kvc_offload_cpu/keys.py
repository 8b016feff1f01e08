"""Content keys of KV blocks: a chained hash of each full block's tokens.

Block ``k``'s key fingerprints the whole prefix ``tokens[: (k + 1) * block_size]``,
so a shared prefix gives the same keys in every request, and a hit on block
``k`` implies the blocks before it match too. vLLM's own ``block_hashes`` are
used when its hash block size divides ours (they also cover LoRA, multimodal
inputs and cache salts); otherwise the keys are our own BLAKE2b chain over the
token ids, from a root of the request's cache salt (a tenant's blocks are its
own, as in vLLM's hashes), the same in every process (never Python's ``hash()``).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Any

#: Parent of block 0 in our own chain; bump the version if the key format changes.
ROOT = b"kvc-offload-cpu/v1"
DIGEST_SIZE = 16


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of one block given its parent's key (deterministic across processes)."""
    words = array("q", token_ids)
    if sys.byteorder != "little":  # pragma: no cover - same bytes on every host
        words.byteswap()
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    h.update(words.tobytes())
    return h.digest()


def root(cache_salt: str = "") -> bytes:
    """The parent of block 0 of a request with ``cache_salt`` ("": none)."""
    if not cache_salt:
        return ROOT
    return hashlib.blake2b(ROOT + b"/salt/" + cache_salt.encode(), digest_size=DIGEST_SIZE).digest()


class RequestKeys:
    """Keys of one request's full blocks, extended as the request grows."""

    __slots__ = ("keys", "_ratio")

    def __init__(self, vllm_hash_ratio: int | None) -> None:
        self.keys: list[bytes] = []
        #: ``block_size // hash_block_size`` when vLLM's hashes are usable, else None.
        self._ratio = vllm_hash_ratio

    def ensure(self, request: Any, num_blocks: int, block_size: int) -> int:
        """Make keys for blocks ``[0, num_blocks)`` available; returns how many are.

        ``request`` is a :class:`composer.RequestView`. Fewer keys come back
        when the request does not hold that many full blocks of tokens yet.
        """
        if len(self.keys) >= num_blocks:
            return num_blocks
        hashes = request.block_hashes if self._ratio else ()
        if hashes:
            ratio = self._ratio
            assert ratio is not None
            limit = min(num_blocks, len(hashes) // ratio)
            for k in range(len(self.keys), limit):
                self.keys.append(bytes(hashes[(k + 1) * ratio - 1]))
            return limit
        tokens = request.all_token_ids
        limit = min(num_blocks, len(tokens) // block_size)
        parent = self.keys[-1] if self.keys else root(request.tenant)
        for k in range(len(self.keys), limit):
            parent = chain_hash(parent, tokens[k * block_size : (k + 1) * block_size])
            self.keys.append(parent)
        return limit
