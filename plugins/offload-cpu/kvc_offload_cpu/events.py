"""vLLM KV cache events for the blocks the tier holds (the scheduler half's side).

A router that indexes vLLM's KV cache events (vLLM's ``--kv-events-config``
ZMQ publisher, vllm-router's ``kv_aware`` policy, llm-d) sees the CPU tier
through them: a ``BlockStored`` once every worker confirmed a block's save, a
``BlockRemoved`` when the tier evicts it, drops it (load error, checksum
failure), resets its pool or shuts down. They are vLLM's own event classes
(``vllm/distributed/kv_events.py``) with the self-describing payload vLLM's
``OffloadingConnector`` gives its CPU tier
(``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``,
``OffloadingEventsTracker``), one tier block per event: the block's hash, its
parent's, its tokens, ``block_size``, LoRA, ``medium="CPU"``, ``group_idx``
and the group's KV cache spec kind. ``ownership`` is left None: the chain
names the node there (``composer/chain/reports.py``).

Hashes are vLLM's own ``request.block_hashes`` (the hash of the prefix ending
at the block, at the group's block size), the ones vLLM's prefix cache
publishes for the same tokens, whatever key the tier indexes the block by; the
payload is captured when the save is planned, while the request is alive, and
only the hash and group are kept until the block leaves the tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def vllm_events_enabled(vllm_config: Any) -> bool | None:
    """Whether vLLM publishes KV cache events (None: not running inside vLLM)."""
    if vllm_config is None:
        return None
    kv_events = getattr(vllm_config, "kv_events_config", None)
    return bool(kv_events is not None and getattr(kv_events, "enable_kv_cache_events", False))


class TierEvents:
    """Builds and queues the tier's events, in the order the tier changed."""

    def __init__(self, kv_cache_config: Any, block_size: int, hash_ratio: int) -> None:
        # vLLM is imported here only: the scheduler half runs inside vLLM, and
        # nothing is imported when events are off.
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored_type, self._removed_type = BlockStored, BlockRemoved
        self._medium = MEDIUM_CPU
        #: vLLM's hash as its events carry it (a 64-bit int unless
        #: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, then the bytes).
        self._external: Callable[[Any], Any] = maybe_convert_block_hash
        self.block_size = block_size
        #: ``block_size // hash_block_size``: block ``k``'s hash is ``block_hashes[(k+1)*r - 1]``.
        self.hash_ratio = hash_ratio
        self.specs = [_spec_fields(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
        self._queue: list[Any] = []
        #: Whether a block saved without vLLM's hash (not announced) was logged.
        self.warned = False

    def block_stored(self, request: Any, group: int, k: int) -> Any | None:
        """The ``BlockStored`` of block ``k`` of ``group`` of ``request`` (a
        :class:`composer.RequestView`), or None when vLLM has no hash for it."""
        hashes: Sequence[bytes] = request.block_hashes
        r, bs = self.hash_ratio, self.block_size
        if len(hashes) < (k + 1) * r:
            return None
        lora = getattr(getattr(request, "raw", None), "lora_request", None)
        kind, window = self.specs[group]
        return self._stored_type(
            block_hashes=[self._external(hashes[(k + 1) * r - 1])],
            parent_block_hash=self._external(hashes[k * r - 1]) if k else None,
            token_ids=list(request.all_token_ids[k * bs : (k + 1) * bs]),
            block_size=bs,
            lora_id=lora.adapter_id if lora is not None else None,
            medium=self._medium,
            lora_name=lora.name if lora is not None else None,
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
        )

    def announce(self, event: Any) -> tuple[Any, int]:
        """Queue a ``BlockStored``; returns what its ``BlockRemoved`` will need."""
        self._queue.append(event)
        return event.block_hashes[0], event.group_idx

    def remove(self, announced: tuple[Any, int]) -> None:
        """Queue the removal of an announced block (consecutive ones of a group share one)."""
        block_hash, group = announced
        last = self._queue[-1] if self._queue else None
        if type(last) is self._removed_type and last.group_idx == group:
            last.block_hashes.append(block_hash)
        else:
            self._queue.append(
                self._removed_type(block_hashes=[block_hash], medium=self._medium, group_idx=group)
            )

    def take(self) -> list[Any]:
        """The events since the last call, oldest first."""
        out, self._queue = self._queue, []
        return out


def _spec_fields(spec: Any) -> tuple[str | None, int | None]:
    """vLLM's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` of a group,
    as ``get_offloading_event_group_spec`` reads them."""
    try:
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        return get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)
    except Exception:  # not one of vLLM's spec classes (a test's stand-in)
        return None, None
