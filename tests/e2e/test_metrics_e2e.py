"""`kvc serve`'s /metrics: every node's counters and gauges, with node and plugin labels,
scraped from a real server; `kvc top --once` reads the same server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from composer import scrape
from composer.bench import replay
from composer.bench import run as bench_run
from composer.bench import servers as bench_servers
from composer.trace import TraceRequest

pytestmark = pytest.mark.e2e


def test_metrics_show_every_node_and_kvc_top_reads_them(
    tiny_model: str, engine_env: dict[str, str], offload_pipeline: Path, tmp_path: Path
) -> None:
    pipeline = offload_pipeline
    config = bench_servers.Config("cpu", pipeline, prefix_caching=False)
    spec = bench_servers.ServerSpec(
        model=tiny_model, max_model_len=1024, extra_args=["--enforce-eager"], env=engine_env
    )
    # The same four 128-token trace blocks twice (512 tokens, 16 blocks): the
    # second request loads 15 blocks from the tier (one token is always computed).
    trace = [TraceRequest(4 * 512, 64, (0, 1, 2, 3))] * 2
    prompts, _ = replay.make_prompts(
        trace, scale=4, vocab_size=replay.vocab_size_of(tiny_model) or 512
    )
    with bench_servers.server(config, spec, tmp_path / "serve.log") as base:
        before = scrape.nodes(scrape.fetch(base))
        # Listed before any request, at 0.
        assert before["cpu"].plugin == "offload-cpu"
        assert before["cpu"].counters["lookups"] == 0
        result = bench_run.measure("cpu", base, prompts, concurrency=1, speedup=1.0, progress=False)
        assert result.errors == 0, [r.error for r in result.records]
        text = _raw(base)
        samples = scrape.parse(text)
        top = subprocess.run(
            [sys.executable, "-m", "composer.cli", "top", base, "--once", "--interval", "0.5"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    cpu = scrape.nodes(samples)["cpu"]
    # One lookup per request (one request at a time, sync loads), counted once.
    assert cpu.counters["lookups"] == 2 and cpu.counters["hits"] == 1
    assert cpu.counters["tokens_loaded"] == 480 == result.node_tokens["cpu"]
    # What the node served, settled when the request finished, is what arrived.
    assert cpu.counters["requests_hit"] == 1 and cpu.counters["requests_looked_up"] == 2
    assert cpu.counters["prompt_tokens_hit"] == 480 == cpu.counters["tokens_hit"]
    assert cpu.counters["bytes_loaded"] > 0 and cpu.counters["bytes_saved"] > 0
    assert 0 < cpu.gauges["pool_use"] < 1
    assert not cpu.disabled
    # The series are proper Prometheus metrics with the engine's labels and ours.
    series = [s for s in samples if s.name == "vllm:kv_composer_tokens_loaded_total"]
    assert series and {"node", "plugin", "engine", "model_name"} <= set(series[0].labels)
    assert "# TYPE vllm:kv_composer_tokens_loaded_total counter" in text
    assert "# TYPE vllm:kv_composer_gauge gauge" in text
    # The requests' own usage agrees: with vLLM's prefix cache off, every cached
    # token came from the tier.
    assert sum(r.cached_tokens or 0 for r in result.records) == 480
    assert result.connector_tokens == 480  # vLLM's own count of the connector's tokens
    assert top.returncode == 0, top.stderr
    assert "cpu" in top.stdout and "offload-cpu" in top.stdout
    # Per request and per prompt token, each request counted once however often
    # vLLM looked it up: 2 requests of 512 tokens, the second served 480.
    assert cpu.counters["requests_looked_up"] == 2 and cpu.counters["requests_hit"] == 1
    assert cpu.counters["prompt_tokens_looked_up"] == 1024
    assert cpu.counters["prompt_tokens_hit"] == 480
    assert "50.0%" in top.stdout and "46.9%" in top.stdout  # 1 of 2 requests; 480 of 1024


def _raw(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())
