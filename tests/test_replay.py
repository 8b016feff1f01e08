"""`kvc bench`'s replay without an engine: prompts from trace hash ids, the client
against a local streaming HTTP server, the statistics, the report and the CLI's errors."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from composer.bench import fleet as bench_fleet
from composer.bench import replay
from composer.bench import report as bench_report
from composer.bench import servers as bench_servers
from composer.bench.replay import BenchError
from composer.bench.servers import Config, PortTaken, ServerSpec, server_command
from composer.trace import KeyMaker, TraceRequest, read_trace

TRACES = Path(__file__).parent / "data" / "traces"
PIPELINE = str(Path(__file__).parents[1] / "examples" / "fleet-cpu-events.yaml")
PD = str(Path(__file__).parents[1] / "examples" / "pd-nixl.yaml")


def req(ids: tuple[int, ...], input_length: int, output: int = 512, t: float = 0) -> TraceRequest:
    return TraceRequest(input_length, output, ids, t)


def test_the_same_hash_id_gives_the_same_tokens_in_every_maker() -> None:
    a = replay.PromptMaker(32, 500).prompt(0, req((7, 8, 9), 3 * 512))
    b = replay.PromptMaker(32, 500).prompt(5, req((7, 8, 10), 3 * 512))
    assert a.token_ids[:64] == b.token_ids[:64]  # shared prefix: ids 7, 8
    assert a.token_ids[64:] != b.token_ids[64:]
    assert all(replay.FIRST_TOKEN_ID <= t < 500 for t in a.token_ids + b.token_ids)


def test_the_partial_last_block_is_unique_to_its_request() -> None:
    maker = replay.PromptMaker(32, 500)
    a = maker.prompt(0, req((1, 2), 512 + 256))
    b = maker.prompt(1, req((1, 2), 512 + 256))
    assert len(a.token_ids) == 32 + 16
    assert a.token_ids[:32] == b.token_ids[:32] and a.token_ids[32:] != b.token_ids[32:]


def test_lengths_scale_as_kvc_simulate_counts_them() -> None:
    trace = read_trace(TRACES / "mooncake-conversation_trace-500.jsonl", limit=50)
    prompts, skipped = replay.make_prompts(trace, scale=16, vocab_size=512)
    keys = KeyMaker(32, replay.trace_block_tokens(16))
    assert not skipped
    assert [len(p.token_ids) for p in prompts] == [keys.prompt_tokens(r) for r in trace]
    assert [p.max_tokens for p in prompts] == [max(1, r.output_length // 16) for r in trace]
    assert prompts[-1].arrival_s == trace[-1].timestamp_ms / 1000


def test_requests_that_do_not_fit_are_skipped_and_named() -> None:
    trace = [req((1,), 512, 512), req((1, 2, 3, 4), 4 * 512, 512)]
    prompts, skipped = replay.make_prompts(trace, scale=4, vocab_size=512, max_model_len=256)
    assert [p.index for p in prompts] == [0] and skipped == [1]


@pytest.mark.parametrize("scale", [0, 3, 1024])
def test_a_scale_that_does_not_divide_512_is_refused(scale: int) -> None:
    with pytest.raises(replay.BenchError, match="--scale must divide 512"):
        replay.trace_block_tokens(scale)


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert bench_report.percentile(values, 50) == 50
    assert bench_report.percentile(values, 90) == 90
    assert bench_report.percentile(values, 99) == 99
    assert bench_report.percentile([], 50) is None


class _Streaming(BaseHTTPRequestHandler):
    """An OpenAI-style streaming completions endpoint: one chunk a token, then usage."""

    delay_s = 0.05
    bodies: list[dict] = []
    headers: list[dict[str, str]] = []
    in_flight = 0
    peak = 0
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body["sent_s"] = time.perf_counter()  # when it arrived (the tests read it)
        cls = type(self)
        with cls.lock:
            cls.bodies.append(body)
            cls.headers.append({k.lower(): v for k, v in self.headers.items()})
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
        try:
            if body["max_tokens"] == 13:
                self.send_response(400)
                self.end_headers()
                self.wfile.write(b'{"error": "bad"}')
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(cls.delay_s)
            for _ in range(body["max_tokens"]):
                chunk = {"choices": [{"text": "x"}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {
                "choices": [],
                "usage": {
                    "prompt_tokens": len(body["prompt"]),
                    "completion_tokens": body["max_tokens"],
                    "prompt_tokens_details": {"cached_tokens": 32},
                },
            }
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        finally:
            with cls.lock:
                cls.in_flight -= 1


@pytest.fixture
def server() -> Iterator[str]:
    _Streaming.bodies, _Streaming.peak, _Streaming.in_flight = [], 0, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Streaming)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _prompts(n: int, max_tokens: int = 3) -> list[replay.Prompt]:
    return [replay.Prompt(i, [5] * 40, max_tokens, i * 0.1) for i in range(n)]


def test_fixed_concurrency_keeps_that_many_in_flight(server: str) -> None:
    records, wall = replay.replay(server, "m", _prompts(8), concurrency=4)
    assert [r.index for r in records] == list(range(8))
    assert all(r.error is None for r in records)
    assert _Streaming.peak == 4
    assert all(r.output_tokens == 3 and r.cached_tokens == 32 for r in records)
    assert all(r.ttft_s is not None and r.e2e_s is not None for r in records)
    assert all(r.ttft_s <= r.e2e_s for r in records)  # type: ignore[operator]
    body = _Streaming.bodies[0]
    assert body["stream"] and body["ignore_eos"] and body["prompt"] == [5] * 40


def test_arrival_times_are_kept_divided_by_the_speedup(server: str) -> None:
    start = time.perf_counter()
    records, wall = replay.replay(server, "m", _prompts(5), speedup=2.0)
    # The last request arrives at 0.4 s of trace time, 0.2 s after a 2x speedup.
    assert wall >= 0.2 and time.perf_counter() - start >= 0.2
    assert len(records) == 5 and all(r.error is None for r in records)


def test_prompts_are_sent_in_arrival_order_whatever_their_order_in_the_list(
    server: str,
) -> None:
    # Two traces merged: each sorted, the whole not. Each arrives at its own time.
    merged = [*_prompts(3), *(replace(p, index=p.index + 3) for p in _prompts(3))]
    start = time.perf_counter()
    records, _ = replay.replay(server, "m", merged, speedup=1.0)
    assert [r.index for r in records] == list(range(6))
    sent = sorted(_Streaming.bodies, key=lambda b: b["sent_s"])
    assert [round(b["sent_s"] - start, 1) for b in sent] == [0.0, 0.0, 0.1, 0.1, 0.2, 0.2]


def test_tenant_and_kv_transfer_params_are_sent_as_vllm_reads_them(server: str) -> None:
    retention = {"kv_retention": {"ttl_s": 30.0, "pin": None, "priority": 0}}
    prompt = replay.Prompt(0, [5] * 40, 2, 0.0, "s", "acme", retention)
    (record,) = replay.replay(server, "m", [prompt], concurrency=1)[0]
    body = _Streaming.bodies[0]
    assert body["cache_salt"] == "acme" and body["kv_transfer_params"] == retention
    assert record.tenant == "acme"
    (plain,) = replay.replay(server, "m", _prompts(1), concurrency=1)[0]
    assert "cache_salt" not in _Streaming.bodies[1] and plain.tenant == ""


def test_errors_are_counted_not_raised(server: str) -> None:
    prompts = _prompts(2) + [replay.Prompt(2, [5] * 40, 13, 0.0)]
    records, wall = replay.replay(server, "m", prompts, concurrency=2)
    result = bench_report.RunResult("x", records, wall)
    assert result.errors == 1 and "HTTP 400" in (records[2].error or "")
    assert result.summary()["requests"] == 3


def test_unreachable_server_is_an_error_per_request() -> None:
    record = replay.send("http://127.0.0.1:9", "m", _prompts(1)[0], timeout=5)
    assert record.error is not None and record.ttft_s is None


def test_report_table_json_and_plot(tmp_path: Path) -> None:
    fast = [replay.Record(i, 100, 4, 0, 0.01 * (i + 1), 0.05) for i in range(10)]
    slow = [replay.Record(i, 100, 4, 0, 0.1 * (i + 1), 0.5) for i in range(10)]
    results = [
        bench_report.RunResult("prefix", fast, 1.0, prompt_tokens=1000, prefix_cache_tokens=250),
        bench_report.RunResult("none", slow, 2.0, prompt_tokens=1000, node_tokens={"cpu": 500}),
    ]
    written = bench_report.write_report(results, tmp_path)
    table = (tmp_path / "bench.md").read_text()
    assert "| prefix | 10 | 0 | 50 | 90 | 100 |" in table
    assert "vllm prefix cache 25.0%" in table and "cpu 50.0%" in table
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data[1]["requests_per_s"] == 5.0 and len(data[1]["records"]) == 10
    png = tmp_path / "ttft-cdf.png"
    assert png in written and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _kvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "composer.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_usage_errors_exit_2_without_a_traceback(tmp_path: Path) -> None:
    trace = str(TRACES / "mooncake-synthetic_trace-200.jsonl")
    cases = [
        ((trace, "--url", "http://127.0.0.1:9", "--scale", "3"), "--scale must divide 512"),
        ((trace,), "exactly one of --model and --url"),
        ((trace, "--model", "m", "--config", "nope.yaml"), "'none', 'prefix' or a pipeline"),
        ((trace, "--url", "http://x", "--config", "none"), "--config starts servers"),
        ((trace, "--model", "m", "--policy", "round_robin"), "give --fleet N or --pd too"),
        ((trace, "--model", "m", "--pd"), "--pd runs one pipeline on both engines"),
        ((trace, "--url", "http://x", "--pd"), "--pd starts its engines: give --model"),
        ((trace, "--model", "m", "--pd", "--fleet", "2", "--config", PD), "one at a time"),
        (
            (trace, "--model", "m", "--pd", "--config", PD, "--policy", "kv_aware-tiers"),
            "--policy kv_aware-tiers needs KV events",
        ),
        (
            (trace, "--model", "m", "--pd", "--config", PD, "--policy", "round_robin")
            + ("--policy", "cache_aware"),
            "--pd takes at most one --policy",
        ),
        ((trace, "--model", "m", "--fleet", "2"), "one --config PIPELINE"),
        ((trace, "--model", "m", "--fleet", "2", "--config", PIPELINE), "the model's vocabulary"),
        ((trace, "--url", "http://x", "--fleet", "2"), "give --model, not --url"),
        (
            (trace, "--model", "m", "--fleet", "2", "--config", PIPELINE, "--policy", "random"),
            "--policy 'random': one of round_robin, consistent_hash",
        ),
        ((trace, "--model", "m", "--fleet", "0", "--config", PIPELINE), "--fleet must be >= 1"),
        ((trace, "--model", "m", "--warm-up", "1"), "--warm-up warms a fleet's engines"),
        (
            (trace, "--model", "m", "--fleet", "2", "--config", PIPELINE, "--warm-up", "-1"),
            "--warm-up must be >= 0, got -1",
        ),
    ]
    for args, message in cases:
        proc = _kvc("bench", *args, "--output", str(tmp_path))
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 3}\n')
    proc = _kvc("bench", str(bad), "--url", "http://x")
    assert proc.returncode == 2 and f"{bad}:1: " in proc.stderr


def test_the_session_names_the_conversation_in_a_header(server: str) -> None:
    prompt = replay.Prompt(0, [5] * 40, 2, 0.0, session="7-8-9")
    assert replay.send(server, "m", prompt).error is None
    assert _Streaming.headers[-1]["x-session-id"] == "7-8-9"
    assert replay.send(server, "m", _prompts(1)[0]).error is None
    assert "x-session-id" not in _Streaming.headers[-1]


def test_a_pd_runs_columns_say_what_each_node_served_on_each_engine_and_nixl_moved() -> None:
    records = [replay.Record(i, 100, 4, 0, 0.1, 0.2) for i in range(2)]
    pd = bench_report.RunResult(
        "pd", records, 1.0, prompt_tokens=400, engine_requests=[2, 2],
        side_tokens={"decode:nixl": 198, "prefill:cpu": 0}, nixl_bytes=3 * 2**20,
    )
    plain = bench_report.RunResult("plain (cache_aware)", records, 1.0, engine_requests=[2, 0])
    table = bench_report.markdown_table([pd, plain])
    assert "| tokens served by engine:node | NIXL MiB |" in table
    assert "| decode:nixl 198 | 3.0 |" in table and "| - | 0.0 |" in table
    pooled = bench_report.pool(pd, pd)
    assert pooled.side_tokens["decode:nixl"] == 396 and pooled.nixl_bytes == 6 * 2**20
    assert pooled.engine_requests == [4, 4]
    summary = pd.summary()
    assert summary["tokens_served_by_engine_and_node"]["decode:nixl"] == 198


def test_a_fleets_engines_are_counted_busiest_first_and_pooled_like_with_like() -> None:
    record = [replay.Record(0, 10, 1, 0, 0.1, 0.2)]
    a = bench_report.RunResult("kv", record, 1.0, engine_requests=[30, 0])
    b = bench_report.RunResult("kv", record, 1.0, engine_requests=[28, 2])
    assert a.imbalance == 2.0 and bench_report.pool(a, b).engine_requests == [58, 2]
    # The router's CPU, a request: added when pooled; unknown once either run's is.
    cpu = [replace(a, router_cpu_s=0.004), replace(b, router_cpu_s=0.002)]
    assert bench_report.pool(*cpu).summary()["router_cpu_ms_per_request"] == pytest.approx(3.0)
    assert bench_report.pool(cpu[0], b).summary()["router_cpu_ms_per_request"] is None
    table = bench_report.markdown_table([a])
    assert "| requests by engine (busiest first) | imbalance |" in table
    assert "| 30/0 | 2.00 |" in table
    one = bench_report.RunResult("one", record, 1.0)
    assert one.imbalance is None and "requests by engine" not in bench_report.markdown_table([one])


def test_the_benchmark_pipelines_are_valid() -> None:
    from composer.validation import load_pipeline

    files = sorted((Path(__file__).parents[1] / "benchmarks" / "serving").glob("*.yaml"))
    assert len(files) == 2
    for file in files:
        assert bench_servers.Config.parse(str(file)).pipeline == file
        load_pipeline(file)


def test_rounds_pool_a_configurations_requests_and_counts() -> None:
    a = bench_report.RunResult(
        "cpu",
        [replay.Record(0, 10, 1, 0, 0.1, 0.2)],
        2.0,
        prompt_tokens=10,
        node_tokens={"cpu": 4},
        preemptions=1,
    )
    b = bench_report.RunResult(
        "cpu",
        [replay.Record(0, 10, 1, 0, 0.3, 0.4)],
        3.0,
        prompt_tokens=10,
        node_tokens={"cpu": 2, "l2": 1},
        preemptions=2,
    )
    pooled = bench_report.pool(a, b)
    assert len(pooled.records) == 2 and pooled.wall_s == 5.0
    assert pooled.node_tokens == {"cpu": 6, "l2": 1} and pooled.preemptions == 3
    assert pooled.summary()["served"]["cpu"] == 0.3


def test_the_tiers_hits_are_set_against_vllms_count() -> None:
    record = [replay.Record(0, 10, 1, 0, 0.1, 0.2)]
    counted = bench_report.RunResult(
        "cpu", record, 1.0, prompt_tokens=100, connector_tokens=40, node_tokens={"cpu": 30}
    )
    assert counted.tier_over_vllm == 0.75 and counted.summary()["tier_over_vllm"] == 0.75
    assert "(tier ÷ vLLM 0.75)" in bench_report.markdown_table([counted])
    for none in (replace(counted, connector_tokens=0), replace(counted, node_tokens={})):
        assert none.tier_over_vllm is None and "tier ÷ vLLM" not in bench_report.markdown_table(
            [none]
        )


def test_a_server_given_cores_runs_every_process_on_them(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ServerSpec(model="m", cpus="1")
    pinned = server_command(Config.parse("none"), spec, 8000)
    taskset = shutil.which("taskset")
    assert pinned[:3] == [taskset, "-c", "1"]
    assert pinned[3:] == server_command(Config.parse("none"), replace(spec, cpus=None), 8000)
    pipeline = server_command(Config.parse("examples/cpu-offload.yaml"), spec, 8000)
    assert pipeline[:3] == [taskset, "-c", "1"] and "serve" in pipeline
    # Without taskset the server still runs, unbound (and the log says so).
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert server_command(Config.parse("none"), spec, 8000) == pinned[3:]


@pytest.mark.parametrize(("said", "error"), [
    ("zmq.error.ZMQError: Address already in use (addr='tcp://*:39213')", PortTaken),
    ("RuntimeError: Engine core initialization failed", BenchError),
])
def test_a_server_that_exits_says_whether_a_port_was_taken(
    tmp_path: Path, said: str, error: type[BenchError]
) -> None:
    log = tmp_path / "server.log"
    log.write_text(f"starting\n{said}\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    with pytest.raises(BenchError) as raised:
        bench_servers.wait_healthy("http://127.0.0.1:9", proc, log, timeout=5)
    assert type(raised.value) is error and said in str(raised.value)


def test_a_fleet_whose_port_was_taken_starts_again_on_new_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    starts: list[list[str]] = []

    @contextlib.contextmanager
    def servers(wanted: list[tuple[Config, ServerSpec, Path]]) -> Iterator[list[Any]]:
        starts.append([spec.extra_args[-1] for _, spec, _ in wanted])  # the events config
        if len(starts) < fails + 1:
            raise PortTaken("server exited with 1; log tail:\nAddress already in use")
        yield [SimpleNamespace(url=f"http://e{i}", proc=SimpleNamespace(pid=i))
               for i in range(len(wanted))]

    monkeypatch.setattr(bench_fleet, "servers", servers)
    config, spec = Config.parse("examples/cpu-offload.yaml"), ServerSpec(model="m")
    fails = 2  # the last attempt starts
    with bench_fleet.fleet(config, spec, 2, tmp_path) as engines:
        assert [e.url for e in engines] == ["http://e0", "http://e1"]
    assert len(starts) == bench_fleet.PORT_ATTEMPTS and len({s[0] for s in starts}) == 3
    starts.clear()
    fails = bench_fleet.PORT_ATTEMPTS  # every attempt finds a port taken
    with pytest.raises(PortTaken), bench_fleet.fleet(config, spec, 2, tmp_path):
        pass
    assert len(starts) == bench_fleet.PORT_ATTEMPTS
