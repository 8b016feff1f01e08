"""The servers ``kvc bench`` measures: one per configuration, health-checked, stopped.

A configuration is ``none`` (no connector, no prefix cache), ``prefix`` (vLLM's
prefix cache only) or a pipeline file (``kvc serve`` with it). Each server runs
on a free loopback port in its own process group, and is always stopped with
everything it started, also when the body of :func:`server` fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer.bench.replay import BenchError
from composer.servers import process
from composer.servers.loopback import LOOPBACK, free_port
from composer.servers.vllm_serve import vllm_command


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
    #: The cores every process of the server runs on (``taskset -c``), when it must
    #: not share theirs with another engine's; None: wherever the kernel puts them.
    cpus: str | None = None
    #: ``kvc serve --kv-role``: the P/D side a pipeline server plays (None: the file's).
    kv_role: str | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 600


def server_command(config: Config, spec: ServerSpec, port: int) -> list[str]:
    args = [
        spec.model,
        "--host",
        LOOPBACK,
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
    pinned = []
    if spec.cpus is not None:
        taskset = shutil.which("taskset")
        if taskset is None:  # (util-linux's; the server runs, unbound)
            import structlog  # lazily: it costs `kvc --help` more than the rest

            structlog.get_logger("kv_composer").warning(
                "taskset not found: the server's processes are not bound to cores", cpus=spec.cpus
            )
        else:
            pinned = [taskset, "-c", spec.cpus]
    if config.pipeline is None:
        return [*pinned, *vllm_command(), "serve", *args]
    kvc = Path(sys.executable).with_name("kvc")
    launcher = [str(kvc)] if kvc.exists() else [sys.executable, "-m", "composer.cli"]
    role = ["--kv-role", spec.kv_role] if spec.kv_role else []
    return [*pinned, *launcher, "serve", *role, str(config.pipeline), "--", *args]


@contextlib.contextmanager
def server(config: Config, spec: ServerSpec, log_path: Path) -> Iterator[str]:
    """A server for ``config`` on a free loopback port, healthy; yields its base URL.
    Always stopped (with everything it started), also when the body fails."""
    with servers([(config, spec, log_path)]) as (started,):
        yield started.url


@dataclass(frozen=True)
class Server:
    url: str
    proc: subprocess.Popen[Any]
    log_path: Path

    def kill(self) -> None:
        """Killed now, with everything it started (SIGKILL: no goodbye to its peers)."""
        process.kill_group(self.proc)


@contextlib.contextmanager
def servers(wanted: Sequence[tuple[Config, ServerSpec, Path]]) -> Iterator[list[Server]]:
    """Several servers, started side by side (a start is mostly imports and waiting:
    two take little longer than one), each healthy, in order. All stopped, also
    when a start or the body fails."""
    started: list[tuple[Server, float]] = []
    with contextlib.ExitStack() as stack:
        for config, spec, log_path in wanted:
            port = free_port()
            env = {
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
                "VLLM_CPU_OMP_THREADS_BIND": spec.threads_bind,
                "TOKENIZERS_PARALLELISM": "false",
                **spec.env,
            }
            proc = process.spawn(server_command(config, spec, port), log_path, env=env)
            stack.callback(process.stop_group, proc)
            running = Server(f"http://{LOOPBACK}:{port}", proc, log_path)
            started.append((running, spec.startup_timeout_s))
        for running, timeout in started:
            wait_healthy(running.url, running.proc, running.log_path, timeout)
        yield [running for running, _ in started]


class PortTaken(BenchError):
    """A server exited because a port it was given was taken (chosen free, then bound
    by another process before the server bound it): worth a start on new ports."""


def wait_healthy(base: str, proc: subprocess.Popen[Any], log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            taken = "Address already in use" in log_path.read_text(errors="replace")
            error = PortTaken if taken else BenchError
            raise error(
                f"server exited with {proc.returncode}; log tail:\n{process.tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BenchError(
                    f"server not healthy after {timeout:.0f} s; see {log_path}"
                ) from None
            time.sleep(1)
