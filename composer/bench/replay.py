"""``kvc bench``'s requests: a trace's prompts, and sending them to a server.

A Mooncake trace (see :mod:`composer.trace`) becomes real prompts of token
ids: each hash id is a fixed block of ``trace_block_tokens`` token ids (the
same id always gives the same tokens, in every run and process), the partial
last block is filler unique to its request, so the trace's prefix sharing is
kept exactly. Lengths are divided by ``scale`` (512 tokens a hash id become
``512 // scale``), as ``kvc simulate --trace-block-tokens`` does, so that the
prediction and the replay see the same token sequences.

The prompts are sent as streamed completions, at the trace's arrival times
divided by ``speedup`` or at a fixed concurrency; each gives a :class:`Record`
(TTFT, latency, tokens). The servers are :mod:`composer.bench.servers`', the
run over every configuration :mod:`composer.bench.run`'s, the report
:mod:`composer.bench.report`'s. Standard library only (plus ``rich`` for the
progress bar and matplotlib for the plot): no torch, no vLLM in this process."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from composer.controls import RETENTION
from composer.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, conversation

#: Token ids below this are left out of generated prompts (special tokens of small vocabularies).
FIRST_TOKEN_ID = 2


class BenchError(Exception):
    """A usage or environment problem of ``kvc bench`` (bad option, server would not start)."""


# --------------------------------------------------------------------------- #
# prompts
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Prompt:
    index: int
    token_ids: list[int]
    max_tokens: int
    #: Seconds after the start of the run (trace arrival time, not yet sped up).
    arrival_s: float
    #: The request's conversation (:func:`composer.trace.conversation`), sent as
    #: ``x-session-id``: what a router's session affinity keys on.
    session: str = ""
    #: Whose request it is, sent as vLLM's ``cache_salt`` ("": none).
    tenant: str = ""
    #: Sent as the request's ``kv_transfer_params`` (its ``kv_retention``, tier controls).
    kv_transfer_params: dict[str, Any] | None = None


def trace_block_tokens(scale: int) -> int:
    if scale < 1 or MOONCAKE_BLOCK_TOKENS % scale:
        raise BenchError(
            f"--scale must divide {MOONCAKE_BLOCK_TOKENS} (1, 2, 4, ..., 512), got {scale}"
        )
    return MOONCAKE_BLOCK_TOKENS // scale


class PromptMaker:
    """Token ids for trace requests; the same hash id always gives the same block."""

    def __init__(self, block_tokens: int, vocab_size: int, seed: int = 0) -> None:
        if vocab_size <= FIRST_TOKEN_ID + 1:
            raise BenchError(f"vocabulary of {vocab_size} tokens is too small")
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[int, list[int]] = {}

    def _random(self, key: str, n: int) -> list[int]:
        # random.Random seeded with a str hashes it with SHA-512: stable across processes.
        rng = random.Random(f"{self.seed}:{key}")
        return [rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(n)]

    def block(self, hash_id: int) -> list[int]:
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            tokens = self._blocks[hash_id] = self._random(f"id:{hash_id}", self.block_tokens)
        return tokens

    def scaled(self, tokens: int) -> int:
        return tokens * self.block_tokens // MOONCAKE_BLOCK_TOKENS

    def prompt(self, index: int, req: TraceRequest, max_output_tokens: int | None = None) -> Prompt:
        full, rest = divmod(req.input_length, MOONCAKE_BLOCK_TOKENS)
        ids: list[int] = []
        for hash_id in req.hash_ids[:full]:
            ids.extend(self.block(hash_id))
        # The partial last block: unique to this request (as kvc simulate assumes).
        ids.extend(self._random(f"req:{index}", self.scaled(rest)))
        if not ids:
            ids = self._random(f"req:{index}", 1)
        out = max(1, self.scaled(req.output_length))
        if max_output_tokens is not None:
            out = min(out, max_output_tokens)
        params = None if req.retention is None else {RETENTION: asdict(req.retention)}
        arrival = req.timestamp_ms / 1000.0
        return Prompt(index, ids, out, arrival, conversation(req), req.tenant, params)


def make_prompts(
    trace: Sequence[TraceRequest],
    *,
    scale: int,
    vocab_size: int,
    max_output_tokens: int | None = None,
    max_model_len: int | None = None,
    seed: int = 0,
) -> tuple[list[Prompt], list[int]]:
    """The prompts of ``trace``, and the trace indexes left out because prompt +
    output would not fit ``max_model_len``."""
    maker = PromptMaker(trace_block_tokens(scale), vocab_size, seed)
    prompts: list[Prompt] = []
    skipped: list[int] = []
    for index, req in enumerate(trace):
        prompt = maker.prompt(index, req, max_output_tokens)
        if max_model_len is not None and len(prompt.token_ids) + prompt.max_tokens > max_model_len:
            skipped.append(index)
            continue
        prompts.append(prompt)
    return prompts, skipped


def vocab_size_of(model: str) -> int | None:
    """``vocab_size`` from a local model directory's config.json (None if not local)."""
    config = Path(model) / "config.json"
    try:
        value = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) else None


# --------------------------------------------------------------------------- #
# one request
# --------------------------------------------------------------------------- #


@dataclass
class Record:
    index: int
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None
    #: Whose request it was (its ``cache_salt``; "": none).
    tenant: str = ""


def send(base_url: str, model: str, prompt: Prompt, timeout: float = 600) -> Record:
    """One streamed completion; TTFT is the time to the first streamed token."""
    record = Record(prompt.index, len(prompt.token_ids), tenant=prompt.tenant)
    body = {
        "model": model,
        "prompt": prompt.token_ids,
        "max_tokens": prompt.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if prompt.tenant:
        body["cache_salt"] = prompt.tenant
    if prompt.kv_transfer_params is not None:
        body["kv_transfer_params"] = prompt.kv_transfer_params
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    start = time.perf_counter()
    try:
        headers = {"Content-Type": "application/json"}
        if prompt.session:
            headers["x-session-id"] = prompt.session
        conn.request(
            "POST", url.path.rstrip("/") + "/v1/completions", body=json.dumps(body), headers=headers
        )
        resp = conn.getresponse()
        if resp.status != 200:
            record.error = f"HTTP {resp.status}: {resp.read()[:200].decode(errors='replace')}"
            return record
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices") and record.ttft_s is None:
                record.ttft_s = time.perf_counter() - start
            usage = chunk.get("usage")
            if usage:
                record.output_tokens = int(usage.get("completion_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    record.cached_tokens = int(details["cached_tokens"])
        record.e2e_s = time.perf_counter() - start
        if record.ttft_s is None:
            record.error = "no token streamed"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return record


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=30) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def replay(
    base_url: str,
    model: str,
    prompts: Sequence[Prompt],
    *,
    concurrency: int | None = None,
    speedup: float = 1.0,
    on_done: Callable[[Record], None] | None = None,
    pause_s: float = 0.0,
) -> tuple[list[Record], float]:
    """Send ``prompts``: ``concurrency`` at a time in trace order, or else each at
    its arrival time divided by ``speedup``. Returns the records (in prompt order)
    and the wall time. ``pause_s``: with ``concurrency``, seconds between a
    request's end and the next one's start (a router counts a request's end a
    moment after the client does)."""
    records: list[Record | None] = [None] * len(prompts)
    lock = threading.Lock()

    def run(position: int) -> None:
        record = send(base_url, model, prompts[position])
        with lock:
            records[position] = record
            if on_done is not None:
                on_done(record)
        if pause_s and concurrency is not None:
            time.sleep(pause_s)

    start = time.perf_counter()
    if concurrency is not None:
        if concurrency < 1:
            raise BenchError(f"--concurrency must be >= 1, got {concurrency}")
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            list(pool.map(run, range(len(prompts))))
    else:
        if speedup <= 0:
            raise BenchError(f"--speedup must be > 0, got {speedup}")
        first = min((p.arrival_s for p in prompts), default=0.0)
        threads: list[threading.Thread] = []
        # In arrival order (a trace need not be sorted; merged traces are not).
        order = sorted(range(len(prompts)), key=lambda i: prompts[i].arrival_s)
        for position in order:
            prompt = prompts[position]
            delay = (prompt.arrival_s - first) / speedup - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
            thread = threading.Thread(target=run, args=(position,), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
    wall = time.perf_counter() - start
    return [r for r in records if r is not None], wall
