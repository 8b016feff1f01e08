"""`kvc serve`: a real `vllm serve` with a composed pipeline, on loopback, always
stopped; its /metrics (every node's counters and gauges, with node and plugin
labels) and `kvc top` reading them.

One server for the module, a CPU tier in front of vLLM's ExampleConnector: the
metrics are read first, while every counter is still at 0.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from composer import scrape
from composer.bench import replay
from composer.bench import run as bench_run
from composer.bench import servers as bench_servers
from composer.trace import TraceRequest

pytestmark = pytest.mark.e2e
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass
class Served:
    base: str
    model: str
    log: Path


@pytest.fixture(scope="module")
def served(
    tiny_model: str, engine_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("serve")
    pipeline = folder / "pipeline.yaml"
    pipeline.write_text(
        "version: 1\n"
        "annotate_outputs: true\n"
        "nodes:\n"
        "  cpu:\n"
        "    plugin: offload-cpu\n"
        "    config: {capacity: 64MiB, save: prompt, save_mode: sync}\n"
        "  ex:\n"
        "    plugin: vllm\n"
        "    config:\n"
        "      connector: ExampleConnector\n"
        f"      extra_config: {{shared_storage_path: {folder / 'store'}}}\n"
    )
    config = bench_servers.Config("composed", pipeline, prefix_caching=False)
    spec = bench_servers.ServerSpec(
        model=tiny_model, max_model_len=1024, extra_args=["--enforce-eager"], env=engine_env
    )
    log = folder / "serve.log"
    with bench_servers.server(config, spec, log) as base:
        yield Served(base, tiny_model, log)


def get(url: str, payload: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else {}


def test_metrics_show_every_node_and_kvc_top_reads_them(served: Served) -> None:
    base, tiny_model = served.base, served.model
    # The same four 128-token trace blocks twice (512 tokens, 16 blocks): the
    # second request loads 15 blocks from the tier (one token is always computed).
    trace = [TraceRequest(4 * 512, 64, (0, 1, 2, 3))] * 2
    prompts, _ = replay.make_prompts(
        trace, scale=4, vocab_size=replay.vocab_size_of(tiny_model) or 512
    )
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


def test_kvc_serve_runs_vllm_with_the_pipeline(served: Served) -> None:
    base, tiny_model, log = served.base, served.model, served.log
    prompt = "the cache block token layer model vllm connector offload memory " * 6
    body = {"model": tiny_model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = get(f"{base}/v1/completions", body)
    second = get(f"{base}/v1/completions", body)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    # The repeat was served by the pipeline's node, not recomputed.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # Per-node counters reach vLLM's stat logger (it logs every ~10 s).
    deadline = time.monotonic() + 30
    while "ex.lookups=" not in log.read_text():
        assert time.monotonic() < deadline, "no per-node KV transfer metrics were logged"
        time.sleep(1)
    line = next(x for x in log.read_text().splitlines() if "ex.lookups=" in x)
    assert "KV Transfer metrics: " in line and "ex.hits=" in line and "cpu.lookups=" in line
    _tier_controls(base, tiny_model, body["prompt"])


def _tier_controls(base: str, model: str, prompt: str) -> None:
    """examples/tier_controls.py against the server: a request's kv_transfer_params
    restrict the nodes it loads from, and bad controls come back as an error."""
    spec = importlib.util.spec_from_file_location("tier_controls", EXAMPLES / "tier_controls.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def cached(out: dict) -> int:
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(example.complete(base, model, prompt, kv_load_tiers=["ex"])) > 0
    assert cached(example.complete(base, model, prompt, kv_load_tiers=[])) == 0
    bad = example.complete(base, model, prompt, kv_load_tiers=["no-such-node"])
    assert cached(bad) == 0
    error = bad["kv_transfer_params"]["kv_composer"]["error"]
    assert "kv_load_tiers: unknown node(s) 'no-such-node'" in error and "'ex'" in error
    # kv_retention: the CPU tier's retention policy takes a pin (in vLLM's scheduler
    # process, at the request's end); a malformed one is refused with its reason.
    pinned = example.complete(base, model, prompt, kv_retention={"ttl_s": 60, "pin": True})
    assert "error" not in ((pinned.get("kv_transfer_params") or {}).get("kv_composer") or {})
    bad = example.complete(base, model, prompt, kv_retention={"ttl_s": -1})
    assert cached(bad) == 0
    error = bad["kv_transfer_params"]["kv_composer"]["error"]
    assert error == "tier controls: kv_retention.ttl_s: expected seconds from 0 to 86400, got -1"
    # The example's own run prints one line per request, the bad one with its error.
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert example.main(["tier_controls.py", base, model, "ex"]) == 0
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 6 and "unknown node(s)" in lines[3], lines
    assert lines[4].startswith('{"kv_retention": ') and "error" not in lines[4], lines


def _raw(base: str) -> str:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())
