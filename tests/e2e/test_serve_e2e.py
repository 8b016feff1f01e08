"""`kvc serve`: a real `vllm serve` with a composed pipeline, on loopback, always stopped."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import time
import urllib.request
from pathlib import Path

import pytest

from composer.bench import servers as bench_servers

pytestmark = pytest.mark.e2e
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def get(url: str, payload: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else {}


def test_kvc_serve_runs_vllm_with_the_pipeline(
    tiny_model: str, engine_env: dict[str, str], tmp_path: Path
) -> None:
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(
        "version: 1\n"
        "annotate_outputs: true\n"
        "nodes:\n"
        "  ex:\n"
        "    plugin: vllm\n"
        "    config:\n"
        "      connector: ExampleConnector\n"
        f"      extra_config: {{shared_storage_path: {tmp_path / 'store'}}}\n"
    )
    config = bench_servers.Config("ex", pipeline, prefix_caching=False)
    spec = bench_servers.ServerSpec(model=tiny_model, max_model_len=1024, env=engine_env)
    log = tmp_path / "serve.log"
    with bench_servers.server(config, spec, log) as base:
        prompt = "the cache block token layer model vllm connector offload memory " * 6
        body = {"model": tiny_model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        first = get(f"{base}/v1/completions", body)
        second = get(f"{base}/v1/completions", body)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        # The repeat was served by the pipeline's node, not recomputed.
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # Per-node counters reach vLLM's stat logger (it logs every ~10 s).
        deadline = time.monotonic() + 30
        while "KV Transfer metrics: ex." not in log.read_text():
            assert time.monotonic() < deadline, "no per-node KV transfer metrics were logged"
            time.sleep(1)
        line = next(x for x in log.read_text().splitlines() if "KV Transfer metrics" in x)
        assert "ex.lookups=" in line and "ex.hits=" in line
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
    # The example's own run prints one line per request, the bad one with its error.
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert example.main(["tier_controls.py", base, model, "ex"]) == 0
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 5 and "unknown node(s)" in lines[3], lines
