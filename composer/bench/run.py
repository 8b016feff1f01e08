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
from typing import Any

from composer import scrape
from composer.bench.fleet import run_fleet
from composer.bench.pd import run_pd
from composer.bench.replay import BenchError, Prompt, replay, served_model
from composer.bench.report import RunResult, engine_counters, pool
from composer.bench.servers import server
from composer.bench.spec import BenchSpec, bench_prompts


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
        concurrency=concurrency,
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


def run(spec: BenchSpec) -> list[RunResult]:
    """Every configuration (or the server at ``url``), one after the other."""
    if spec.url is None and spec.server is None:
        raise BenchError("kvc bench needs --model (to start servers) or --url")
    if spec.fleet and spec.pd:
        raise BenchError("--fleet and --pd: one at a time")
    if spec.fleet:
        return run_fleet(spec)
    if spec.pd:
        return run_pd(spec)
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
