"""``kvc simulate --fleet N --router POLICY``: a trace through N engines behind a router.

Each engine is a replay of its own (:class:`composer.simulate._Replay`: its
vLLM prefix cache and its nodes' models); the router model picks the engine of
each request, in trace order, one request at a time. The policies are
``kvc bench --fleet``'s, modelled on what vllm-router 0.1.17 does with the
bench's requests (token-id prompts, ``x-session-id`` naming the conversation):

* ``round_robin``: engines in turn;
* ``consistent_hash``: one engine per conversation
  (:func:`composer.trace.conversation`), by a hash of it (the router's ring of
  worker URLs is another partition of the same conversations);
* ``cache_aware``: the router's own guess of each engine's cache is built from
  request text, and a token-id prompt has none: every request goes to the
  first engine (measured: 366 of 366);
* ``kv_aware-vllm`` / ``kv_aware-tiers``: the engine whose KV events credit the
  most of the prompt: its vLLM prefix cache in full, what its nodes hold after
  that at the router's external rate (0.6; KV Composer's events name their
  node in ``ownership``) or not at all (``-vllm``); with no credit anywhere,
  the least loaded engine, which one request at a time is the first.

The load a router balances is not modelled (requests are one at a time), so
the load-blind policies are predicted at any concurrency and the kv_aware ones
for requests sent one at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from composer.pipeline import ResolvedPipeline
from composer.simulate.replay import _check_options, _Replay
from composer.simulate.tiers import VLLM_CACHE_ID, SimKVGroup, SimulateError
from composer.trace import MOONCAKE_BLOCK_TOKENS, KeyMaker, TraceRequest, conversation

#: The router's credit for a block a node holds (vllm-router 0.1.17's default
#: external rate), per policy; vLLM's prefix cache is credited in full.
TIER_CREDIT = {"kv_aware-vllm": 0.0, "kv_aware-tiers": 0.6}
ROUTERS = ("round_robin", "consistent_hash", "cache_aware", *TIER_CREDIT)


@dataclass
class FleetResult:
    router: str
    engines: int
    requests: int
    prompt_tokens: int
    #: Requests each engine served, busiest first (as ``kvc bench --fleet`` reports them).
    engine_requests: list[int]
    #: Prompt tokens served, by vLLM's prefix cache (``<vllm>``) and by each node.
    tokens_served: dict[str, int] = field(default_factory=dict)

    @property
    def fraction_served(self) -> float:
        return sum(self.tokens_served.values()) / self.prompt_tokens if self.prompt_tokens else 0.0

    def fraction(self, node: str) -> float:
        return self.tokens_served.get(node, 0) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float | None:
        """The busiest engine's requests over the mean (1.0: even)."""
        if len(self.engine_requests) < 2 or not self.requests:
            return None
        return max(self.engine_requests) / (self.requests / len(self.engine_requests))

    def as_dict(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "engines": self.engines,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "requests_by_engine": self.engine_requests,
            "imbalance": self.imbalance,
            "tokens_served": self.tokens_served,
            "fraction_served": self.fraction_served,
        }


def simulate_fleet(
    pipeline: ResolvedPipeline,
    trace: Sequence[TraceRequest],
    *,
    engines: int,
    router: str,
    bytes_per_block: int,
    block_size: int = 32,
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    vllm_cache_blocks: int = 0,
    groups: Sequence[SimKVGroup] | None = None,
) -> FleetResult:
    """Replay ``trace`` through ``engines`` copies of ``pipeline`` behind ``router``.

    Every block is replayed (as ``kvc simulate --exact``): an engine's prefix
    cache and tiers hold what the real ones would, block for block."""
    _check_options(bytes_per_block, block_size, trace_block_tokens, vllm_cache_blocks)
    if engines < 1:
        raise SimulateError(f"--fleet must be >= 1, got {engines}")
    if router not in ROUTERS:
        raise SimulateError(f"--router {router!r}: one of {', '.join(ROUTERS)}")
    kv_groups = tuple(groups or (SimKVGroup("attention", bytes_per_block),))
    keymaker = KeyMaker(block_size, trace_block_tokens)
    replays = [
        _Replay(pipeline, {}, keymaker, 1, bytes_per_block, vllm_cache_blocks, kv_groups)
        for _ in range(engines)
    ]
    choose = _router(router, replays)
    counts = [0] * engines
    for i, req in enumerate(trace):
        engine = choose(i, req)
        counts[engine] += 1
        replays[engine].request(req)
    served: dict[str, int] = {}
    for replay in replays:
        for row in replay.rows(len(trace)):
            if row.lookup:
                served[row.id] = served.get(row.id, 0) + row.tokens_served
    return FleetResult(
        router,
        engines,
        len(trace),
        sum(r.prompt_total for r in replays),
        sorted(counts, reverse=True),
        served,
    )


def _router(name: str, replays: list[_Replay]) -> Callable[[int, TraceRequest], int]:
    n = len(replays)
    if name == "round_robin":
        return lambda i, req: i % n
    if name == "consistent_hash":
        return lambda i, req: _stable_hash(conversation(req)) % n
    if name == "cache_aware":
        return lambda i, req: 0
    credit = TIER_CREDIT[name]

    def kv_aware(i: int, req: TraceRequest) -> int:
        best, best_score = 0, 0.0
        for engine, replay in enumerate(replays):
            _, keys, limit = replay.units(req)
            gpu, tier = replay.holds(keys, limit)
            score = gpu + credit * tier
            if score > best_score:
                best, best_score = engine, score
        return best

    return kv_aware


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def format_fleet(results: Sequence[FleetResult]) -> str:
    """One row per router: requests by engine, imbalance, and what served the prompts."""
    nodes = sorted({n for r in results for n in r.tokens_served}, key=lambda n: n != VLLM_CACHE_ID)
    header = ["router", "requests by engine (busiest first)", "imbalance", *nodes, "total served"]
    rows = [header]
    for r in results:
        imbalance = "-" if r.imbalance is None else f"{r.imbalance:.2f}"
        rows.append(
            [
                r.router,
                "/".join(map(str, r.engine_requests)),
                imbalance,
                *(f"{100 * r.fraction(n):.1f}%" for n in nodes),
                f"{100 * r.fraction_served:.1f}%",
            ]
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    first = results[0] if results else None
    title = (
        f"{first.engines} engines, {first.requests:,} requests, {first.prompt_tokens:,} prompt "
        "tokens (vLLM's prefix cache is the <vllm> column)"
        if first
        else ""
    )
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([title, *lines])
