"""``kvc bench``'s results: one configuration's requests and counters, and the report.

:class:`RunResult` holds a run's records and the server's counters around it;
``pool`` joins two runs of one configuration; the report is ``bench.md`` (a
markdown table), ``bench.json`` (every request) and ``ttft-cdf.png``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from composer import scrape
from composer.bench.replay import Record


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
    #: Bytes each node copied into vLLM's KV cache, and out of it into its store.
    node_bytes_loaded: dict[str, float] = field(default_factory=dict)
    node_bytes_saved: dict[str, float] = field(default_factory=dict)
    #: A fleet's run: the requests each engine finished, busiest engine first
    #: (a P/D run: the prefill engine's, then the decode engine's).
    engine_requests: list[float] = field(default_factory=list)
    #: A P/D run: the prompt tokens each node served on each engine, by the chain's
    #: account (``tokens_hit``: every node, vLLM's own connectors included), keyed
    #: ``"ENGINE:NODE"`` (``prefill:cpu``, ``decode:nixl``).
    side_tokens: dict[str, float] = field(default_factory=dict)
    #: A P/D run: bytes NIXL moved (vLLM's ``vllm:nixl_bytes_transferred``, all engines).
    nixl_bytes: float = 0.0
    #: Requests in flight (``--concurrency``); None: sent at the trace's timestamps.
    concurrency: int | None = None
    #: A fleet's run: CPU seconds vllm-router used during the replay (every thread; its
    #: work per request differs by policy: ``kv_aware`` reads every engine's KV events).
    router_cpu_s: float | None = None

    @property
    def imbalance(self) -> float | None:
        """The busiest engine's requests over the mean (1.0: even); None for one server."""
        if len(self.engine_requests) < 2 or not sum(self.engine_requests):
            return None
        mean = sum(self.engine_requests) / len(self.engine_requests)
        return max(self.engine_requests) / mean

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.records) - len(self.ok)

    def fraction(self, tokens: float) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def tenants(self) -> dict[str, float]:
        """Per tenant (the trace's ``tenant``, sent as ``cache_salt``) when any is named:
        the prompt tokens vLLM counted as cached (its prefix cache and the connector)
        over the prompt tokens, by its requests' own usage."""
        if not any(r.tenant for r in self.records):
            return {}
        prompt: dict[str, int] = {}
        cached: dict[str, int] = {}
        for r in self.ok:
            prompt[r.tenant] = prompt.get(r.tenant, 0) + r.prompt_tokens
            cached[r.tenant] = cached.get(r.tenant, 0) + (r.cached_tokens or 0)
        return {t: cached[t] / prompt[t] if prompt[t] else 0.0 for t in sorted(prompt)}

    @property
    def tier_over_vllm(self) -> float | None:
        """The prompt tokens the nodes say they served over those vLLM counts as the
        connector's (``vllm:external_prefix_cache_hits``): 1.0 when every hit a tier
        reports reached a request; None without a hit."""
        if not self.connector_tokens or not self.node_tokens:
            return None
        return sum(self.node_tokens.values()) / self.connector_tokens

    def summary(self) -> dict[str, Any]:
        ok = self.ok
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
        return {
            "config": self.config,
            "concurrency": self.concurrency,
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
            "tier_over_vllm": self.tier_over_vllm,
            "requests_by_engine": self.engine_requests,
            "imbalance": self.imbalance,
            "served": {
                "vllm prefix cache": self.fraction(self.prefix_cache_tokens),
                "connector": self.fraction(self.connector_tokens),
                **{node: self.fraction(t) for node, t in self.node_tokens.items()},
            },
            "bytes_loaded": self.node_bytes_loaded,
            "bytes_saved": self.node_bytes_saved,
            "tokens_served_by_engine_and_node": self.side_tokens,
            "nixl_bytes": self.nixl_bytes,
            "served_by_tenant": self.tenants(),
            "router_cpu_ms_per_request": 1000 * self.router_cpu_s / len(self.records)
            if self.router_cpu_s is not None and self.records
            else None,
        }

    def as_dict(self) -> dict[str, Any]:
        return {**self.summary(), "records": [asdict(r) for r in self.records]}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:,.0f}"


def markdown_table(results: Sequence[RunResult]) -> str:
    fleet = any(r.engine_requests for r in results)
    pd = any(r.side_tokens or r.nixl_bytes for r in results)
    lines = [
        "| config | requests | errors | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | e2e p50 ms "
        "| e2e p90 ms | e2e p99 ms | req/s | output tok/s | preemptions "
        + ("| requests by engine (busiest first) | imbalance " if fleet else "")
        + "| prompt tokens served "
        + ("| tokens served by engine:node | NIXL MiB " if pd else "")
        + "|",
        "| --- " + "| ---: " * 11 + ("| ---: | ---: " if fleet else "") + "| --- "
        + ("| --- | ---: " if pd else "") + "|",
    ]
    for result in results:
        s = result.summary()
        served = ", ".join(f"{k} {100 * v:.1f}%" for k, v in s["served"].items() if v) or "0%"
        if result.tier_over_vllm is not None:
            served += f" (tier ÷ vLLM {result.tier_over_vllm:.2f})"
        if s["served_by_tenant"]:
            served += "; by tenant: " + ", ".join(
                f"{t or '-'} {100 * v:.1f}%" for t, v in s["served_by_tenant"].items()
            )
        engines = ""
        if fleet:
            by_engine = "/".join(f"{n:.0f}" for n in result.engine_requests)
            imbalance = "-" if result.imbalance is None else f"{result.imbalance:.2f}"
            engines = f"| {by_engine} | {imbalance} "
        lines.append(
            f"| {s['config']} | {s['requests']} | {s['errors']} | {_ms(s['ttft_s']['p50'])} "
            f"| {_ms(s['ttft_s']['p90'])} | {_ms(s['ttft_s']['p99'])} "
            f"| {_ms(s['e2e_s']['p50'])} | {_ms(s['e2e_s']['p90'])} | {_ms(s['e2e_s']['p99'])} "
            f"| {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} "
            f"| {s['preemptions']} {engines}| {served} "
            + (_pd_cells(result) if pd else "")
            + "|"
        )
    return "\n".join(lines)


def _pd_cells(result: RunResult) -> str:
    sides = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(result.side_tokens.items()) if v)
    return f"| {sides or '-'} | {result.nixl_bytes / 2**20:,.1f} "


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


def pool(a: RunResult, b: RunResult) -> RunResult:
    """Two runs of one configuration as one: requests together, times and counts added."""

    def added(x: dict[str, float], y: dict[str, float]) -> dict[str, float]:
        return {n: x.get(n, 0.0) + y.get(n, 0.0) for n in {*x, *y}}

    return RunResult(
        a.config,
        a.records + b.records,
        a.wall_s + b.wall_s,
        skipped=a.skipped + b.skipped,
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        prefix_cache_tokens=a.prefix_cache_tokens + b.prefix_cache_tokens,
        connector_tokens=a.connector_tokens + b.connector_tokens,
        preemptions=a.preemptions + b.preemptions,
        node_tokens=added(a.node_tokens, b.node_tokens),
        node_bytes_loaded=added(a.node_bytes_loaded, b.node_bytes_loaded),
        node_bytes_saved=added(a.node_bytes_saved, b.node_bytes_saved),
        engine_requests=[x + y for x, y in zip(a.engine_requests, b.engine_requests, strict=True)],
        side_tokens=added(a.side_tokens, b.side_tokens),
        nixl_bytes=a.nixl_bytes + b.nixl_bytes,
        concurrency=a.concurrency,
        router_cpu_s=None
        if a.router_cpu_s is None or b.router_cpu_s is None
        else a.router_cpu_s + b.router_cpu_s,
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
        # What vLLM's NIXL connector moved (a histogram of bytes per transfer).
        "nixl_bytes": scrape.total(samples, "vllm:nixl_bytes_transferred_sum"),
    }
    for node, view in scrape.nodes(samples).items():
        out[f"served:{node}"] = view.counters.get("tokens_hit", 0.0)
        out[f"node:{node}"] = view.counters.get("tokens_loaded", 0.0)
        out[f"bytes_loaded:{node}"] = view.counters.get("bytes_loaded", 0.0)
        out[f"bytes_saved:{node}"] = view.counters.get("bytes_saved", 0.0)
    return out
