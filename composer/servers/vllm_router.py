"""vLLM's own router (``vllm-router``) in front of running engines: loopback, free ports,
ready-checked, always stopped.

``kvc bench --fleet`` routes through it. The binary comes from the
``vllm-router`` wheel (the ``fleet`` extra). Facts this module relies on,
measured with vllm-router 0.1.17:

* it listens only once a worker answers ``/health``, and then on
  ``--worker-startup-check-interval`` (30 s by default, 1 here); its
  ``/readiness`` counts the healthy workers (``healthy_workers``);
* its Prometheus endpoint is its own port (``--prometheus-port``): ``/metrics``
  on the routing port is passed through to a worker;
* ``kv_aware`` subscribes (ZMQ SUB, connecting) to each engine's KV event
  publisher, given as ``--kv-event-source WORKER_URL=tcp://HOST:PORT``: only
  ``tcp://`` with a host, no wildcard, no ``ipc://``; it matches prompts by the
  token ids the ``BlockStored`` events carry (vLLM's hashes only chain them),
  at ``--kv-event-block-size`` tokens a block. A subscriber misses what was
  published before it connected (ZMQ PUB/SUB): ``--kv-event-replay-source``
  names the engine's replay socket, where the router asks for those batches;
* SIGTERM stops it gracefully within about a second.

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from composer.servers import process
from composer.servers.loopback import LOOPBACK, free_port


class RouterError(RuntimeError):
    """No vllm-router binary, or it did not start and see every worker in time."""


@dataclass(frozen=True)
class Disaggregated:
    """Prefill/decode engines for the router's P/D mode (``--vllm-pd-disaggregation``):
    it sends each request to a prefill engine with ``do_remote_decode`` and one
    token, then to a decode engine with the ``kv_transfer_params`` that came back."""

    prefill: Sequence[str]
    decode: Sequence[str]
    #: How the engines move KV (the router's ``--kv-connector``).
    kv_connector: str = "nixl"

    def argv(self) -> list[str]:
        argv = ["--vllm-pd-disaggregation", "--kv-connector", self.kv_connector]
        for url in self.prefill:
            argv += ["--prefill", url]
        for url in self.decode:
            argv += ["--decode", url]
        return argv


@dataclass(frozen=True)
class Router:
    #: Where requests go.
    url: str
    #: The router's own Prometheus endpoint.
    metrics_url: str
    pid: int


def router_binary() -> str:
    """``vllm-router`` beside this Python (its venv), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("vllm-router")
    if found:
        return found
    raise RouterError("no vllm-router: pip install vllm-router (the `fleet` extra)")


def router_argv(
    workers: Sequence[str] | Disaggregated,
    policy_args: Sequence[str],
    port: int,
    metrics_port: int,
    kv_event_sources: Mapping[str, tuple[str, str]] | None = None,
    block_size: int = 16,
) -> list[str]:
    argv = [
        router_binary(),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--prometheus-host",
        LOOPBACK,
        "--prometheus-port",
        str(metrics_port),
        *(workers.argv() if isinstance(workers, Disaggregated) else ["--worker-urls", *workers]),
        "--worker-startup-check-interval",
        "1",
        *policy_args,
    ]
    if kv_event_sources:
        for worker, (endpoint, replay) in kv_event_sources.items():
            argv += ["--kv-event-source", f"{worker}={endpoint}"]
            argv += ["--kv-event-replay-source", f"{worker}={replay}"]
        # An identity the router requires with static sources; it loads nothing.
        argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", "kvc-fleet"]
    return argv


@contextlib.contextmanager
def vllm_router(
    workers: Sequence[str] | Disaggregated,
    policy_args: Sequence[str],
    log_path: Path,
    *,
    kv_event_sources: Mapping[str, tuple[str, str]] | None = None,
    block_size: int = 16,
    startup_timeout: float = 60.0,
) -> Iterator[Router]:
    """The router over ``workers`` (running, healthy engines; or prefill and decode
    engines in its P/D mode), ready when every one counts as healthy; always
    stopped, also when the body fails.
    ``kv_event_sources``: each worker's KV event endpoint and replay endpoint."""
    port, metrics_port = free_port(), free_port()
    while metrics_port == port:
        metrics_port = free_port()
    argv = router_argv(workers, policy_args, port, metrics_port, kv_event_sources, block_size)
    proc = process.spawn(argv, log_path)
    router = Router(
        f"http://{LOOPBACK}:{port}", f"http://{LOOPBACK}:{metrics_port}/metrics", proc.pid
    )
    try:
        count = (
            len(workers.prefill) + len(workers.decode)
            if isinstance(workers, Disaggregated)
            else len(workers)
        )
        _wait_ready(router, proc, count, log_path, startup_timeout)
        yield router
    finally:
        process.stop_group(proc, grace=10.0)


def readiness(url: str, timeout: float = 2.0) -> dict[str, object] | None:
    """The router's ``/readiness`` answer, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/readiness", timeout=timeout) as response:
            answer = json.loads(response.read())
    except (OSError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


def healthy_workers(answer: Mapping[str, object]) -> int | None:
    """The healthy workers a ``/readiness`` answer counts: ``healthy_workers``, or in
    P/D mode (vllm-router 0.1.17) ``{"prefill": {"healthy": N}, "decode": {...}}``."""
    count = answer.get("healthy_workers")
    if isinstance(count, int):
        return count
    healthy = 0
    for side in ("prefill", "decode"):
        counts = answer.get(side)
        if not isinstance(counts, dict) or not isinstance(counts.get("healthy"), int):
            return None
        healthy += counts["healthy"]
    return healthy


def _wait_ready(
    router: Router, proc: subprocess.Popen[bytes], workers: int, log_path: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RouterError(
                f"vllm-router exited with {proc.returncode}; log tail:\n{process.tail(log_path)}"
            )
        answer = readiness(router.url)
        if answer is not None and healthy_workers(answer) == workers:
            return
        if time.monotonic() > deadline:
            process.stop_group(proc, grace=10.0)
            raise RouterError(
                f"vllm-router not ready with {workers} healthy workers after {timeout:.0f} s "
                f"(last /readiness: {answer}); see {log_path}"
            )
        time.sleep(0.2)
