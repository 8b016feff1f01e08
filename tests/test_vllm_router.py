"""vLLM's router as ``kvc bench --fleet`` starts it: the real ``vllm-router`` binary in
front of two stand-in workers (HTTP servers answering ``/health`` and completions),
ready once both count, always stopped, also when the body fails."""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from composer.servers.vllm_router import (
    Disaggregated,
    RouterError,
    healthy_workers,
    readiness,
    router_argv,
    vllm_router,
)


class _Worker(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._json({"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        port = self.server.server_address[1]
        self._json({"choices": [{"text": str(port)}], "usage": {"prompt_tokens": 1}})


@pytest.fixture
def workers() -> Iterator[list[str]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Worker) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def _complete(url: str) -> str:
    body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.loads(response.read())["choices"][0]["text"])


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_round_robin_over_both_workers_then_stopped(workers: list[str], tmp_path: Path) -> None:
    with vllm_router(workers, ["--policy", "round_robin"], tmp_path / "router.log") as router:
        served = {_complete(router.url) for _ in range(4)}
        with urllib.request.urlopen(router.metrics_url, timeout=10) as response:
            assert b"vllm_router" in response.read()
    assert served == {w.rsplit(":", 1)[1] for w in workers}
    assert not _running(router.pid)


def test_stopped_when_the_body_fails(workers: list[str], tmp_path: Path) -> None:
    pid = None
    with (
        pytest.raises(RuntimeError, match="the body failed"),
        vllm_router(workers, ["--policy", "round_robin"], tmp_path / "router.log") as router,
    ):
        pid = router.pid
        raise RuntimeError("the body failed")
    assert pid is not None and not _running(pid)


def test_a_worker_that_never_answers_is_a_clear_error(tmp_path: Path) -> None:
    dead = "http://127.0.0.1:9"
    with pytest.raises(RouterError, match="not ready with 1 healthy workers after 3 s"):  # noqa: SIM117
        with vllm_router(
            [dead], ["--policy", "round_robin"], tmp_path / "r.log", startup_timeout=3
        ):
            pass


def test_kv_event_sources_name_the_publisher_and_its_replay_socket() -> None:
    argv = router_argv(
        ["http://127.0.0.1:1"],
        ["--policy", "kv_aware"],
        2,
        3,
        {"http://127.0.0.1:1": ("tcp://127.0.0.1:4", "tcp://127.0.0.1:5")},
        block_size=32,
    )
    joined = " ".join(argv)
    assert "--kv-event-source http://127.0.0.1:1=tcp://127.0.0.1:4" in joined
    assert "--kv-event-replay-source http://127.0.0.1:1=tcp://127.0.0.1:5" in joined
    assert "--kv-event-block-size 32" in joined and "--host 127.0.0.1" in joined
    assert "--prometheus-host 127.0.0.1" in joined


def test_in_pd_mode_it_is_ready_once_prefill_and_decode_count_then_stopped(
    workers: list[str], tmp_path: Path
) -> None:
    pd = Disaggregated([workers[0]], [workers[1]])
    argv = " ".join(router_argv(pd, (), 2, 3))
    assert "--vllm-pd-disaggregation --kv-connector nixl" in argv
    assert f"--prefill {workers[0]}" in argv and f"--decode {workers[1]}" in argv
    assert "--worker-urls" not in argv
    with vllm_router(pd, (), tmp_path / "router.log") as router:
        answer = readiness(router.url)
        assert answer is not None and healthy_workers(answer) == 2
    assert not _running(router.pid)


@pytest.mark.parametrize(
    ("answer", "healthy"),
    [
        ({"status": "ready", "healthy_workers": 3}, 3),
        ({"status": "ready", "prefill": {"healthy": 1}, "decode": {"healthy": 2}}, 3),
        ({"status": "ready", "prefill": {"healthy": 1}}, None),
        ({"status": "ready", "prefill": {"healthy": "1"}, "decode": {"healthy": 1}}, None),
        ({"status": "not ready"}, None),
    ],
)
def test_healthy_workers_are_read_from_either_answer(
    answer: dict[str, object], healthy: int | None
) -> None:
    assert healthy_workers(answer) == healthy
