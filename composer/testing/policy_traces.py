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

:func:`runs` gives the eight runs (each trace and its controls, a tier each),
:func:`predict` what ``kvc simulate`` says of one, :func:`measure` what a real
engine serving a tier per run does (``tests/e2e/test_sim_vs_real.py``,
``benchmarks/cache_policies.py``).

One trace id is one block (``trace_block_tokens`` = the block size): a request
of ``n`` ids has ``n - 1`` full shared blocks and a partial last block of its
own, so at most ``n - 1`` blocks are ever served. Timestamps are seconds apart
enough for a tiny model on a CPU to finish each request before the next.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from composer.bench import run as bench_run
from composer.bench.replay import Prompt, make_prompts
from composer.bench.report import RunResult
from composer.controls import LOAD_TIERS, STORE_TIERS, Retention
from composer.simulate import simulate
from composer.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest
from composer.validation import load_pipeline

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


# --------------------------------------------------------------------------- #
# the runs: each trace beside its control, a tier each, in one engine
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Run:
    """One trace through one tier of its own (node ``name``)."""

    name: str
    #: Its requests, each tenant named ``<run>.<tenant>``: its blocks are its own.
    trace: list[TraceRequest]
    #: The tier's blocks, and what its config adds to ``save: prompt, save_mode: sync``.
    blocks: int
    config: dict[str, Any]
    #: Replayed at its arrival times (the sessions); else one request at a time.
    timed: bool = False

    def node(self, slot_bytes: int) -> dict[str, Any]:
        """The run's tier, as a pipeline node (``slot_bytes``: one block of every layer)."""
        config = {"capacity": self.blocks * slot_bytes, **SYNC, **self.config}
        return {"plugin": "offload-cpu", "config": config}


#: Saves complete within the step, as the simulator's do at once.
SYNC = {"save": "prompt", "save_mode": "sync"}


def runs(chat: Sequence[TraceRequest], *, share: float = 0.7, think_s: float = 4.0) -> list[Run]:
    """The three traces and their controls: ``solo``, ``shared`` and ``guarded``
    (:func:`two_tenants` of ``chat``; ``guarded`` with ``quotas``), ``ttl``, ``short``
    (a TTL of a quarter of the pause) and ``lru`` (:func:`sessions`), ``pinned`` and
    ``unpinned`` (:func:`pinned_prefix`)."""
    alone, mixed, chat_blocks, share = two_tenants(chat, share=share)
    kept, plain, session_blocks = sessions(think_s=think_s)
    short, _, _ = sessions(think_s=think_s, ttl_s=think_s / 4)
    pinned, unpinned, prefix_blocks = pinned_prefix()

    def run(name: str, trace: list[TraceRequest], blocks: int, **more: Any) -> Run:
        own = [replace(r, tenant=f"{name}.{r.tenant}") for r in trace]
        return Run(name, own, blocks, more.pop("config", {}), **more)

    return [
        run("solo", alone, chat_blocks),
        run("shared", mixed, chat_blocks),
        run("guarded", mixed, chat_blocks, config={"quotas": {"guarded.chat": share}}),
        run("ttl", kept, session_blocks, timed=True),
        run("short", short, session_blocks, timed=True),
        run("lru", plain, session_blocks, timed=True),
        run("pinned", pinned, prefix_blocks),
        run("unpinned", unpinned, prefix_blocks),
    ]


def predict(
    run: Run, slot_bytes: int, block_size: int, trace_block_tokens: int
) -> dict[str, float]:
    """``kvc simulate``'s share of each tenant's prompt tokens served, for ``run``."""
    pipeline = load_pipeline({"version": 1, "nodes": {run.name: run.node(slot_bytes)}})
    result = simulate(
        pipeline,
        run.trace,
        bytes_per_block=slot_bytes,
        block_size=block_size,
        trace_block_tokens=trace_block_tokens,
        exact=True,
    )
    return {t: r.fraction_served for t, r in result.tenants.items()}


def prompts_for(
    trace: Sequence[TraceRequest],
    node: str,
    *,
    vocab: int,
    scale: int,
    output: int,
    max_model_len: int,
) -> tuple[list[TraceRequest], list[Prompt]]:
    """The requests of ``trace`` that fit the model, and their prompts, each restricted
    to tier ``node`` (``kv_load_tiers``/``kv_store_tiers``; its kv_retention kept)."""
    prompts, skipped = make_prompts(
        trace,
        scale=scale,
        vocab_size=vocab,
        max_output_tokens=output,
        max_model_len=max_model_len,
    )
    tiers = {LOAD_TIERS: [node], STORE_TIERS: [node]}
    fits = [r for i, r in enumerate(trace) if i not in set(skipped)]
    return fits, [
        replace(p, kv_transfer_params={**(p.kv_transfer_params or {}), **tiers}) for p in prompts
    ]


def measure(
    base_url: str,
    all_runs: Sequence[Run],
    *,
    vocab: int,
    scale: int,
    output: int,
    max_model_len: int,
) -> dict[str, dict[str, float]]:
    """Each run through its tier of the server at ``base_url`` (vLLM's prefix cache off):
    the share of each tenant's prompt tokens served, by the requests' own usage. The
    timed runs go together, at their arrival times; the others one request at a time."""
    options = {"vocab": vocab, "scale": scale, "output": output, "max_model_len": max_model_len}
    results: dict[str, RunResult] = {}
    timed: list[Prompt] = []
    for run in all_runs:
        fits, prompts = prompts_for(run.trace, run.name, **options)
        if len(fits) != len(run.trace):
            raise ValueError(f"{run.name}: {len(run.trace) - len(fits)} prompts do not fit")
        if run.timed:
            timed += prompts
            continue
        results[run.name] = bench_run.measure(
            run.name,
            base_url,
            prompts,
            concurrency=1,
            speedup=1.0,
            progress=False,
            settle_s=0.0,
        )
    if timed:
        timed = [replace(p, index=i) for i, p in enumerate(timed)]
        results["timed"] = bench_run.measure(
            "timed",
            base_url,
            timed,
            concurrency=None,
            speedup=1.0,
            progress=False,
            settle_s=0.0,
        )
    out: dict[str, dict[str, float]] = {}
    for run in all_runs:
        result = results["timed" if run.timed else run.name]
        if result.errors:
            raise RuntimeError(f"{run.name}: {[r.error for r in result.records if r.error][:3]}")
        out[run.name] = {t: v for t, v in result.tenants().items() if t.startswith(f"{run.name}.")}
    return out
