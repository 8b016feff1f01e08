"""``kvc bench``'s whole run: every configuration's server, the replay, the counters.

For each configuration a server is started (:mod:`composer.bench.servers`),
the trace's prompts are replayed against it (:mod:`composer.bench.replay`), the
server's counters are scraped before and after (:mod:`composer.scrape`), and it
is stopped. Or one running server is targeted by URL. ``rounds`` runs the
configurations several times in alternating order and pools each one's
requests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer import scrape
from composer.bench.replay import (
    BenchError,
    Prompt,
    make_prompts,
    replay,
    served_model,
    vocab_size_of,
)
from composer.bench.report import RunResult, pool
from composer.bench.servers import Config, ServerSpec, server
from composer.trace import TraceRequest


def engine_counters(samples: list[scrape.Sample]) -> dict[str, float]:
    """What a run reads from one engine's ``/metrics``, before and after."""
    out = {
        "requests": scrape.total(samples, "vllm:request_success_total"),
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
        out[f"bytes_loaded:{node}"] = view.counters.get("bytes_loaded", 0.0)
        out[f"bytes_saved:{node}"] = view.counters.get("bytes_saved", 0.0)
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
    before = engine_counters(scrape.fetch(base_url))
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
    after = engine_counters(scrape.fetch(base_url))
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    def per_node(prefix: str) -> dict[str, float]:
        return {k.removeprefix(prefix): v for k, v in delta.items() if k.startswith(prefix)}

    return RunResult(
        name,
        records,
        wall,
        skipped=skipped,
        prompt_tokens=delta["prompt"],
        prefix_cache_tokens=delta["prefix"],
        connector_tokens=delta["connector"],
        preemptions=int(delta["preemptions"]),
        node_tokens=per_node("node:"),
        node_bytes_loaded=per_node("bytes_loaded:"),
        node_bytes_saved=per_node("bytes_saved:"),
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
    #: Engines behind vLLM's router (``kvc bench --fleet``; 0: one server per configuration).
    fleet: int = 0
    #: The router's policies a fleet is run with (:data:`composer.bench.fleet.POLICIES`).
    policies: Sequence[str] = ()
    #: With ``concurrency``: seconds between a request's end and the next one's
    #: start, so that a router's load counts have settled (one request at a time
    #: is then one at a time to the router too).
    pause_s: float = 0.0


def run(spec: BenchSpec) -> list[RunResult]:
    """Every configuration (or the server at ``url``), one after the other."""
    if spec.url is None and spec.server is None:
        raise BenchError("kvc bench needs --model (to start servers) or --url")
    if spec.fleet:
        from composer.bench.fleet import run_fleet

        return run_fleet(spec)
    prompts, skipped = bench_prompts(spec)
    spec.workdir.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {
        "concurrency": spec.concurrency,
        "speedup": spec.speedup,
        "skipped": skipped,
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


def bench_prompts(spec: BenchSpec) -> tuple[list[Prompt], int]:
    """The trace's prompts, and how many of its requests do not fit --max-model-len."""
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
    return prompts, len(skipped)
