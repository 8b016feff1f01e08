"""``kvc trace generate``: a synthetic trace of what the shared Mooncake traces lack, seeded,
in their format (:func:`composer.trace.write_trace`): many tenants, agent sessions
that come back after a think time, contexts that grow long.

Sessions start at random (Poisson, ``session_rate`` a second), each of a
tenant (``tenants``, the first ones busier: a Zipf-like share) and either an
agent (``agent_share`` of them: many turns, short tool outputs, seconds of
think time) or a chat (fewer turns, longer answers, a person's think time).
A session's first prompt is its tenant's system prompt (``system_tokens``,
one hash id per 512 tokens, the same ids in every session of the tenant),
then a context of its own (a document, a code base: ``context_tokens`` on
average); each next turn is the previous prompt, its output and a new
message, so its leading hash ids are the previous turn's: the prefix a cache
serves. A turn arrives when the previous one would have ended
(``decode_s`` a output token) plus a think time (exponential, the kind's
mean); a session ends after its turns (geometric, the kind's mean) or when
its prompt would pass ``max_context_tokens``. Each line names its
``tenant`` (vLLM's ``cache_salt``: tenants share no block).

The first ``requests`` requests in arrival order are written: the same
``seed`` and shape always give the same trace.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, fields
from typing import Any

from composer.simulate.tiers import SimulateError
from composer.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True)
class Kind:
    """A kind of session: its mean turns, think seconds, message and output tokens."""

    turns: float
    think_s: float
    message_tokens: int
    output_tokens: int


#: An agent: a tool call's result back every few seconds; a chat: a person reading.
AGENT = Kind(turns=12.0, think_s=2.0, message_tokens=1024, output_tokens=128)
CHAT = Kind(turns=4.0, think_s=30.0, message_tokens=256, output_tokens=384)


@dataclass(frozen=True)
class TraceShape:
    requests: int = 2000
    tenants: int = 8
    #: New sessions a second.
    session_rate: float = 2.0
    #: Of the sessions, the share that are agents (the rest are chats).
    agent_share: float = 0.5
    #: Each tenant's shared system prompt (whole 512-token blocks are shared).
    system_tokens: int = 1024
    #: A session's own first context, on average (exponential).
    context_tokens: int = 4096
    #: A session ends before a prompt would pass this.
    max_context_tokens: int = 131072
    #: Seconds per output token while a turn's answer is written (before the think time).
    decode_s: float = 0.02
    seed: int = 0

    def checked(self) -> TraceShape:
        problems = []
        if self.requests < 1:
            problems.append("--requests must be >= 1")
        if self.tenants < 1:
            problems.append("--tenants must be >= 1")
        if not 0 < self.session_rate < math.inf:
            problems.append("--session-rate must be a finite number > 0")
        if not 0 <= self.agent_share <= 1:
            problems.append("--agent-share must be between 0 and 1")
        if self.system_tokens < 0 or self.context_tokens < 0:
            problems.append("--system-tokens and --context-tokens must be >= 0")
        if self.max_context_tokens <= self.system_tokens:
            problems.append("--max-context-tokens must be > --system-tokens")
        if not 0 <= self.decode_s < math.inf:
            problems.append("--decode-s must be a finite number >= 0")
        if problems:
            raise SimulateError("; ".join(problems))
        return self


def shape_from(values: dict[str, Any]) -> TraceShape:
    """A shape from option values (None: the default), checked."""
    names = {f.name for f in fields(TraceShape)}
    return TraceShape(**{k: v for k, v in values.items() if k in names and v is not None}).checked()


def generate(shape: TraceShape) -> list[TraceRequest]:
    shape.checked()
    rng = random.Random(shape.seed)
    weights = [1.0 / (t + 1) for t in range(shape.tenants)]  # tenant t's share ~ 1/(t+1)
    ids = _Ids()
    systems = [
        [ids.new() for _ in range(shape.system_tokens // MOONCAKE_BLOCK_TOKENS)]
        for _ in range(shape.tenants)
    ]
    out: list[TraceRequest] = []
    pending: list[float] = []  # arrivals (ms) after the latest session's start
    arrived = 0
    start = 0.0
    while True:
        start += rng.expovariate(shape.session_rate)
        while pending and pending[0] <= start * 1000.0:
            heapq.heappop(pending)
            arrived += 1
        # Every request of a later session arrives after ``start``: once this many
        # arrived before it, the first ``requests`` are final.
        if arrived >= shape.requests:
            break
        tenant = rng.choices(range(shape.tenants), weights)[0]
        kind = AGENT if rng.random() < shape.agent_share else CHAT
        session = _session(shape, rng, ids, systems[tenant], f"tenant-{tenant}", kind, start)
        for r in session:
            heapq.heappush(pending, r.timestamp_ms)
        out += session
    out.sort(key=lambda r: r.timestamp_ms)
    return out[: shape.requests]


class _Ids:
    """Fresh hash ids (the same id always the same 512 tokens)."""

    def __init__(self) -> None:
        self.next = 0

    def new(self) -> int:
        self.next += 1
        return self.next


def _session(
    shape: TraceShape,
    rng: random.Random,
    ids: _Ids,
    system: list[int],
    tenant: str,
    kind: Kind,
    start_s: float,
) -> list[TraceRequest]:
    block = MOONCAKE_BLOCK_TOKENS
    turns = 1 + _geometric(rng, kind.turns - 1)
    length = shape.system_tokens + int(rng.expovariate(1 / shape.context_tokens)
                                       if shape.context_tokens else 0)
    length = max(length, 1)
    #: Ids of the whole blocks of the session so far (a prompt's leading ids).
    full = list(system)
    at = start_s
    out: list[TraceRequest] = []
    for _ in range(turns):
        if length >= shape.max_context_tokens:
            break
        while len(full) < length // block:
            full.append(ids.new())
        partial = [ids.new()] if length % block else []
        output = max(1, int(rng.expovariate(1 / kind.output_tokens)))
        out.append(
            TraceRequest(length, output, (*full[: length // block], *partial),
                         round(at * 1000.0, 3), tenant)
        )
        # The next turn: this prompt, its answer and a new message, after the answer is
        # written and the think time; the blocks this turn ended in partly are new.
        at += output * shape.decode_s + rng.expovariate(1 / kind.think_s)
        length += output + max(1, int(rng.expovariate(1 / kind.message_tokens)))
    return out


def _geometric(rng: random.Random, mean: float) -> int:
    """A geometric count >= 0 of mean ``mean``."""
    if mean <= 0:
        return 0
    p = 1.0 / (1.0 + mean)
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
