"""``kvc bench``: replay a request trace against a real server, per configuration.

A Mooncake trace (see :mod:`composer.simulate`) becomes real prompts of token
ids: each hash id is a fixed block of ``trace_block_tokens`` token ids (the
same id always gives the same tokens, in every run and process), the partial
last block is filler unique to its request, so the trace's prefix sharing is
kept exactly. Lengths are divided by ``scale`` (512 tokens a hash id become
``512 // scale``), as ``kvc simulate --trace-block-tokens`` does, so that the
prediction and the replay see the same token sequences.

For each configuration (``none``: no connector and no prefix cache;
``prefix``: vLLM's prefix cache only; a pipeline file: ``kvc serve`` with it,
prefix cache on) a server is started on a free loopback port, health-checked,
sent the requests (at the trace's arrival times divided by ``speedup``, or at
a fixed concurrency), scraped, and always stopped. Or one running server is
targeted by URL. Standard library only (plus ``rich`` for the progress bar and
matplotlib for the plot): no torch, no vLLM in this process.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from composer import scrape
from composer.simulate import MOONCAKE_BLOCK_TOKENS, TraceRequest

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
        return Prompt(index, ids, out, req.timestamp_ms / 1000.0)


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


def send(base_url: str, model: str, prompt: Prompt, timeout: float = 600) -> Record:
    """One streamed completion; TTFT is the time to the first streamed token."""
    record = Record(prompt.index, len(prompt.token_ids))
    body = {
        "model": model,
        "prompt": prompt.token_ids,
        "max_tokens": prompt.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    start = time.perf_counter()
    try:
        conn.request(
            "POST",
            url.path.rstrip("/") + "/v1/completions",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
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
) -> tuple[list[Record], float]:
    """Send ``prompts``: ``concurrency`` at a time in trace order, or else each at
    its arrival time divided by ``speedup``. Returns the records (in prompt order)
    and the wall time."""
    records: list[Record | None] = [None] * len(prompts)
    lock = threading.Lock()

    def run(position: int) -> None:
        record = send(base_url, model, prompts[position])
        with lock:
            records[position] = record
            if on_done is not None:
                on_done(record)

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
        for position, prompt in enumerate(prompts):
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


# --------------------------------------------------------------------------- #
# servers
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Config:
    """What one server runs: ``none``, ``prefix``, or a pipeline file."""

    name: str
    pipeline: Path | None = None
    prefix_caching: bool = True

    @classmethod
    def parse(cls, text: str) -> Config:
        if text == "none":
            return cls("none", None, prefix_caching=False)
        if text == "prefix":
            return cls("prefix", None, prefix_caching=True)
        path = Path(text)
        if not path.is_file():
            raise BenchError(
                f"--config {text!r}: not 'none', 'prefix' or a pipeline file that exists"
            )
        return cls(path.stem, path, prefix_caching=True)


@dataclass
class ServerSpec:
    model: str
    block_size: int = 32
    max_model_len: int = 4096
    #: vLLM's own KV cache in blocks (--num-gpu-blocks-override); None: VLLM_CPU_KVCACHE_SPACE.
    num_blocks: int | None = None
    kv_cache_gib: float = 1
    threads_bind: str = "0-1"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(config: Config, spec: ServerSpec, port: int) -> list[str]:
    args = [
        spec.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(spec.block_size),
        "--max-model-len",
        str(spec.max_model_len),
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
        "--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching",
    ]
    if spec.num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(spec.num_blocks)]
    args += spec.extra_args
    if config.pipeline is None:
        from composer.serve import vllm_command

        return [*vllm_command(), "serve", *args]
    kvc = Path(sys.executable).with_name("kvc")
    launcher = [str(kvc)] if kvc.exists() else [sys.executable, "-m", "composer.cli"]
    return [*launcher, "serve", str(config.pipeline), "--", *args]


@contextlib.contextmanager
def server(config: Config, spec: ServerSpec, log_path: Path) -> Iterator[str]:
    """A server for ``config`` on a free loopback port, healthy; yields its base URL.
    Always stopped (with everything it started), also when the body fails."""
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": spec.threads_bind,
        "TOKENIZERS_PARALLELISM": "false",
        **spec.env,
    }
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            server_command(config, spec, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, proc, log_path, spec.startup_timeout_s)
            yield base
        finally:
            stop(proc)


def wait_healthy(base: str, proc: subprocess.Popen[Any], log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise BenchError(f"server exited with {proc.returncode}; log tail:\n{tail}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(
                    f"server not healthy after {timeout:.0f} s; see {log_path}"
                ) from None
            time.sleep(1)


def stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to the API server first (vLLM then stops its engine and unlinks its
    shared memory); whatever outlives that, its whole process group, is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


# --------------------------------------------------------------------------- #
# results
# --------------------------------------------------------------------------- #


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class RunResult:
    config: str
    records: list[Record]
    wall_s: float
    skipped: int = 0
    #: Prompt tokens the server counted (``vllm:prompt_tokens``) during the run.
    prompt_tokens: float = 0.0
    #: Prompt tokens vLLM's own prefix cache served during the run.
    prefix_cache_tokens: float = 0.0
    #: Requests vLLM preempted (its KV cache full) during the run; each recomputes or reloads.
    preemptions: int = 0
    #: Prompt tokens the KV connector loaded during the run, as vLLM counts them (all
    #: nodes; a node that does not count its own loads shows here only).
    connector_tokens: float = 0.0
    #: Prompt tokens each KV Composer node loaded during the run, by node id.
    node_tokens: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.records) - len(self.ok)

    def fraction(self, tokens: float) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        ok = self.ok
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
        return {
            "config": self.config,
            "requests": len(self.records),
            "errors": self.errors,
            "skipped": self.skipped,
            "preemptions": self.preemptions,
            "wall_s": self.wall_s,
            "ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
            "e2e_s": {f"p{q}": percentile(e2e, q) for q in (50, 90, 99)},
            "requests_per_s": len(ok) / self.wall_s if self.wall_s else 0.0,
            "output_tokens_per_s": sum(r.output_tokens for r in ok) / self.wall_s
            if self.wall_s
            else 0.0,
            "prompt_tokens": self.prompt_tokens,
            "served": {
                "vllm prefix cache": self.fraction(self.prefix_cache_tokens),
                "connector": self.fraction(self.connector_tokens),
                **{node: self.fraction(t) for node, t in self.node_tokens.items()},
            },
        }

    def as_dict(self) -> dict[str, Any]:
        return {**self.summary(), "records": [asdict(r) for r in self.records]}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:,.0f}"


def markdown_table(results: Sequence[RunResult]) -> str:
    lines = [
        "| config | requests | errors | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms "
        "| e2e p90 ms | e2e p99 ms | req/s | output tok/s | preemptions | prompt tokens served |",
        "| --- " + "| ---: " * 11 + "| --- |",
    ]
    for result in results:
        s = result.summary()
        served = ", ".join(f"{k} {100 * v:.1f}%" for k, v in s["served"].items() if v) or "0%"
        lines.append(
            f"| {s['config']} | {s['requests']} | {s['errors']} | {_ms(s['ttft_s']['p50'])} "
            f"| {_ms(s['ttft_s']['p90'])} | {_ms(s['ttft_s']['p99'])} "
            f"| {_ms(s['e2e_s']['p50'])} | {_ms(s['e2e_s']['p90'])} | {_ms(s['e2e_s']['p99'])} "
            f"| {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} "
            f"| {s['preemptions']} | {served} |"
        )
    return "\n".join(lines)


def plot_ttft_cdf(path: Path, results: Sequence[RunResult]) -> None:
    """A PNG of the TTFT CDF of every configuration (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        ttft = sorted(1000 * r.ttft_s for r in result.ok if r.ttft_s is not None)
        if not ttft:
            continue
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        ax.step(ttft, ys, where="post", label=result.config)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per configuration")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- #
# a whole run
# --------------------------------------------------------------------------- #


def _counters(samples: list[scrape.Sample]) -> dict[str, float]:
    out = {
        "prompt": scrape.total(samples, "vllm:prompt_tokens_total"),
        "prefix": scrape.total(samples, "vllm:prefix_cache_hits_total"),
        "preemptions": scrape.total(samples, "vllm:num_preemptions_total"),
        # vLLM's own count of the prompt tokens its KV connector loaded (all nodes).
        "connector": scrape.total(
            samples, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        ),
    }
    for node, view in scrape.nodes(samples).items():
        out[f"node:{node}"] = view.counters.get("tokens_loaded", 0.0)
    return out


def measure(
    name: str,
    base_url: str,
    prompts: Sequence[Prompt],
    *,
    concurrency: int | None,
    speedup: float,
    skipped: int = 0,
    progress: bool = True,
    settle_s: float = 1.0,
) -> RunResult:
    """Replay ``prompts`` against a running server and read its counters around it."""
    model = served_model(base_url)
    before = _counters(scrape.fetch(base_url))
    with _progress(name, len(prompts), progress) as advance:
        records, wall = replay(
            base_url,
            model,
            prompts,
            concurrency=concurrency,
            speedup=speedup,
            on_done=lambda _: advance(),
        )
    # Counters arrive with the engine's step outputs; the last step's may trail the response.
    time.sleep(settle_s)
    after = _counters(scrape.fetch(base_url))
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    nodes = {k.removeprefix("node:"): v for k, v in delta.items() if k.startswith("node:")}
    return RunResult(
        name,
        records,
        wall,
        skipped=skipped,
        prompt_tokens=delta["prompt"],
        prefix_cache_tokens=delta["prefix"],
        connector_tokens=delta["connector"],
        preemptions=int(delta["preemptions"]),
        node_tokens=nodes,
    )


@contextlib.contextmanager
def _progress(name: str, total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    if not enabled:
        yield lambda: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
    ) as bar:
        task = bar.add_task(name, total=total)
        yield lambda: bar.advance(task)


@dataclass
class BenchSpec:
    trace: Sequence[TraceRequest]
    configs: Sequence[Config]
    server: ServerSpec | None
    url: str | None = None
    scale: int = 16
    concurrency: int | None = None
    speedup: float = 1.0
    max_output_tokens: int | None = None
    vocab_size: int | None = None
    workdir: Path = Path("kvc-bench")
    progress: bool = True
    #: Run the configurations this many times, in alternating order (ABCD, DCBA, ...),
    #: pooling each configuration's requests: a drifting machine load then favours none.
    rounds: int = 1


def run(spec: BenchSpec) -> list[RunResult]:
    """Every configuration (or the server at ``url``), one after the other."""
    if spec.url is None and spec.server is None:
        raise BenchError("kvc bench needs --model (to start servers) or --url")
    vocab = spec.vocab_size
    if vocab is None and spec.server is not None:
        vocab = vocab_size_of(spec.server.model)
    if vocab is None:
        raise BenchError("--vocab-size is needed: the model's vocabulary size is not known")
    max_len = spec.server.max_model_len if spec.server is not None else None
    prompts, skipped = make_prompts(
        spec.trace,
        scale=spec.scale,
        vocab_size=vocab,
        max_output_tokens=spec.max_output_tokens,
        max_model_len=max_len,
    )
    if not prompts:
        raise BenchError("no request of the trace fits --max-model-len")
    spec.workdir.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {
        "concurrency": spec.concurrency,
        "speedup": spec.speedup,
        "skipped": len(skipped),
        "progress": spec.progress,
    }
    if spec.url is not None:
        return [measure(spec.url, spec.url, prompts, **kwargs)]
    assert spec.server is not None
    if spec.rounds < 1:
        raise BenchError(f"--rounds must be >= 1, got {spec.rounds}")
    pooled: dict[str, RunResult] = {}
    for round_index in range(spec.rounds):
        order = list(spec.configs) if round_index % 2 == 0 else list(reversed(spec.configs))
        for config in order:
            log = spec.workdir / f"{config.name}-{round_index + 1}.log"
            with server(config, spec.server, log) as base:
                result = measure(config.name, base, prompts, **kwargs)
            pooled[config.name] = (
                pool(pooled[config.name], result) if config.name in pooled else result
            )
    return [pooled[c.name] for c in spec.configs]


def pool(a: RunResult, b: RunResult) -> RunResult:
    """Two runs of one configuration as one: requests together, times and counts added."""
    nodes = {
        n: a.node_tokens.get(n, 0.0) + b.node_tokens.get(n, 0.0)
        for n in {*a.node_tokens, *b.node_tokens}
    }
    return RunResult(
        a.config,
        a.records + b.records,
        a.wall_s + b.wall_s,
        skipped=a.skipped + b.skipped,
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        prefix_cache_tokens=a.prefix_cache_tokens + b.prefix_cache_tokens,
        connector_tokens=a.connector_tokens + b.connector_tokens,
        preemptions=a.preemptions + b.preemptions,
        node_tokens=nodes,
    )


def write_report(results: Sequence[RunResult], workdir: Path, plot: bool = True) -> list[Path]:
    """``bench.md`` (the table), ``bench.json`` (every request) and ``ttft-cdf.png``."""
    workdir.mkdir(parents=True, exist_ok=True)
    table = workdir / "bench.md"
    table.write_text(markdown_table(results) + "\n")
    data = workdir / "bench.json"
    data.write_text(json.dumps([r.as_dict() for r in results], indent=1) + "\n")
    written = [table, data]
    if plot:
        png = workdir / "ttft-cdf.png"
        plot_ttft_cdf(png, results)
        written.append(png)
    return written
