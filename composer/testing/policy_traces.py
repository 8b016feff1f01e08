"""The three traces that show what cache policies are for, each beside its control, with
the tier size (in blocks) that makes the point: predicted by ``kvc simulate`` and
measured by a real engine on the same memory (``plugins/offload-cpu/tests`` and
``benchmarks/cache_policies.py``).

* :func:`two_tenants`: a chat tenant (a conversation trace) beside a ``scan``
  tenant's one-off long prompts, one after each chat request;
* :func:`sessions`: an agent's sessions that pause (think time) while a
  ``batch`` tenant's one-off prompts pass, with and without ``kv_retention: {ttl_s}``;
* :func:`pinned_prefix`: an app's system prompt, pinned (``kv_retention: {pin:
  true}``) or not, under a ``scan`` tenant's pressure.

One trace id is one block (``trace_block_tokens`` = the block size): a request
of ``n`` ids has ``n - 1`` full shared blocks and a partial last block of its
own, so at most ``n - 1`` blocks are ever served. Timestamps are seconds apart
enough for a tiny model on a CPU to finish each request before the next.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace

from composer.controls import Retention
from composer.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

#: Output tokens of every generated request (in Mooncake units: 512 = one block).
_OUTPUT = 64
#: Ids of generated blocks start here, above any a trace file uses.
_FIRST_ID = 10_000_000


def _request(ids: Sequence[int], at_s: float, tenant: str, **retention: object) -> TraceRequest:
    """A request whose last id is a partial block (half of one) of its own."""
    return TraceRequest(
        input_length=(len(ids) - 1) * MOONCAKE_BLOCK_TOKENS + MOONCAKE_BLOCK_TOKENS // 2,
        output_length=_OUTPUT,
        hash_ids=tuple(ids),
        timestamp_ms=at_s * 1000.0,
        tenant=tenant,
        retention=Retention(**retention) if retention else None,  # type: ignore[arg-type]
    )


def _fresh(ids: Iterator[int], n: int) -> list[int]:
    return [next(ids) for _ in range(n)]


def two_tenants(
    chat: Sequence[TraceRequest], *, scan_blocks: int = 32, share: float = 0.7, gap_s: float = 1.0
) -> tuple[list[TraceRequest], list[TraceRequest], int, float]:
    """``chat`` as the ``chat`` tenant alone, and with a scan prompt of ``scan_blocks``
    unique blocks after each request; the tier's blocks (what ``chat`` ever holds,
    over ``share``, so that within its share it holds all of it) and ``share``."""
    ids = itertools.count(_FIRST_ID)
    alone = [
        replace(r, tenant="chat", timestamp_ms=2 * i * gap_s * 1000.0) for i, r in enumerate(chat)
    ]
    mixed: list[TraceRequest] = []
    for i, r in enumerate(alone):
        mixed.append(r)
        mixed.append(_request(_fresh(ids, scan_blocks + 1), (2 * i + 1) * gap_s, "scan"))
    full = MOONCAKE_BLOCK_TOKENS
    footprint = len({r.hash_ids[: k + 1] for r in chat for k in range(r.input_length // full)})
    return alone, mixed, int(footprint / share) + 1, share


def sessions(
    *,
    count: int = 2,
    turns: int = 3,
    base_blocks: int = 4,
    turn_blocks: int = 2,
    think_s: float = 4.0,
    noise: int = 2,
    noise_blocks: int = 24,
    ttl_s: float = 60.0,
) -> tuple[list[TraceRequest], list[TraceRequest], int]:
    """``count`` agent sessions of ``turns`` turns (each turn's prompt is the last one's
    and ``turn_blocks`` more), ``think_s`` apart, with ``noise`` one-off ``batch``
    prompts of ``noise_blocks`` blocks in every pause: with ``kv_retention: {ttl_s}``
    on every agent request, and without. The sessions' turns come in the pause's
    first eighth and the noise in its third quarter: a TTL of a quarter of the
    pause has ended before the noise, and the noise is done a quarter of the pause
    before the next turn (a real engine replaying it in real time sees the same
    order). The tier holds every session's last turn and one noise prompt, no
    more: LRU has evicted a session when it comes back."""
    ids = itertools.count(_FIRST_ID)
    history = [_fresh(ids, base_blocks) for _ in range(count)]
    plain: list[TraceRequest] = []
    for turn in range(turns):
        start = turn * think_s
        for s in range(count):
            if turn:
                history[s] += _fresh(ids, turn_blocks)
            at = start + s * think_s / (8 * count)
            plain.append(_request([*history[s], next(ids)], at, "agent"))
        for n in range(noise):
            at = start + think_s / 2 + n * think_s / (4 * noise)
            plain.append(_request(_fresh(ids, noise_blocks + 1), at, "batch"))
    kept = [
        replace(r, retention=Retention(ttl_s=ttl_s)) if r.tenant == "agent" else r for r in plain
    ]
    longest = base_blocks + (turns - 1) * turn_blocks
    return kept, plain, count * longest + noise_blocks


def pinned_prefix(
    *,
    prefix_blocks: int = 8,
    requests: int = 6,
    question_blocks: int = 2,
    scan: int = 3,
    scan_blocks: int = 16,
    gap_s: float = 1.0,
) -> tuple[list[TraceRequest], list[TraceRequest], int]:
    """An app's system prompt of ``prefix_blocks`` blocks, sent once alone (pinned, or
    not), then ``requests`` questions on it (``question_blocks`` more each), with
    ``scan`` one-off ``scan`` prompts of ``scan_blocks`` blocks after each. The tier
    holds four times the prefix: a scan's blocks push an unpinned prefix out."""
    ids = itertools.count(_FIRST_ID)
    prefix = _fresh(ids, prefix_blocks)
    at = itertools.count()
    plain = [_request([*prefix, next(ids)], next(at) * gap_s, "app")]
    for _ in range(requests):
        for _ in range(scan):
            plain.append(_request(_fresh(ids, scan_blocks + 1), next(at) * gap_s, "scan"))
        question = [*prefix, *_fresh(ids, question_blocks), next(ids)]
        plain.append(_request(question, next(at) * gap_s, "app"))
    pinned = [replace(plain[0], retention=Retention(pin=True)), *plain[1:]]
    return pinned, plain, 4 * prefix_blocks
