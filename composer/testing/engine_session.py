"""A real vLLM engine kept running between requests, driven from the test process.

``run_engine`` runs its rounds and exits; disaggregated prefill/decode needs
two engines alive at once (the decode side pulls the prompt's KV out of the
prefill side's memory over NIXL after the prefill returned) and a way to act
on an engine between requests (overwrite its KV cache, kill it). An
``EngineSession`` is that: one engine in a child process of its own group,
started once, answering ``generate`` calls over a loopback socket, and always
stopped by ``close()`` (a context manager), a hung one by its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from types import TracebackType
from typing import Any

from composer.testing.engine import (
    EngineFailed,
    EngineSpec,
    Prompt,
    RequestResult,
    _kill_group,
    _wait_reaped,
    build_llm,
    generate,
)

#: Seconds a session waits for its engine to start and connect back.
START_TIMEOUT_S = 300.0


class EngineSession:
    """``with EngineSession(spec) as engine: engine.generate(prompts)``.

    ``spec.rounds`` is ignored; every other setting is ``run_engine``'s, its
    environment (thread binding, KV cache size) included.
    """

    def __init__(self, spec: EngineSpec, name: str = "engine") -> None:
        self.spec = spec
        self.name = name
        self._tmp = tempfile.TemporaryDirectory(prefix=f"kvc-{name}-")
        self.log_path = Path(self._tmp.name) / "engine.log"
        self._conn: Connection | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._listener: Listener | None = None
        self._t0 = 0.0
        self.startup_s = 0.0

    # ------------------------------------------------------------------ life

    def start(self) -> EngineSession:
        """Launch the engine and wait until it serves."""
        return self.launch().wait_ready()

    def launch(self) -> EngineSession:
        """Start the engine's process; :meth:`wait_ready` waits for it. Two sessions
        launched before either waits start side by side."""
        self._key = secrets.token_bytes(16)
        spec_file = Path(self._tmp.name) / "spec.json"
        spec_file.write_text(json.dumps(asdict(self.spec)))
        self._listener = Listener(("127.0.0.1", 0), authkey=self._key)
        host, port = self._listener.address
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.spec.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": self.spec.threads_bind,
            "PYTHONHASHSEED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.spec.in_process else "1",
            **self.spec.env,
            "KVC_SESSION_ADDRESS": f"{host}:{port}",
            "KVC_SESSION_KEY": self._key.hex(),
        }
        self._t0 = time.monotonic()
        with self.log_path.open("w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "composer.testing.engine_session", str(spec_file)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        return self

    def wait_ready(self) -> EngineSession:
        listener = self._listener
        assert listener is not None and self._proc is not None, "launch() first"
        try:
            # accept() blocks; poll the child so that one dying at start fails fast.
            listener._listener._socket.settimeout(1.0)  # type: ignore[attr-defined]
            while self._conn is None:
                try:
                    self._conn = listener.accept()
                except TimeoutError:
                    late = time.monotonic() - self._t0 > START_TIMEOUT_S
                    if self._proc.poll() is not None or late:
                        raise self._failure("did not start") from None
            ready = self._receive(START_TIMEOUT_S)
        finally:
            listener.close()
            self._listener = None
        self.startup_s = float(ready["startup_s"])
        return self

    def close(self) -> bool:
        """Stop the engine (and everything it started); True if a signal was needed."""
        signalled = False
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._conn is not None:
            try:
                self._conn.send({"op": "stop"})
                self._conn.poll(90)
            except (OSError, EOFError):
                pass
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=90)
            signalled = _kill_group(self._proc, grace_s=30)
            _wait_reaped(self._proc.pid)
            self._proc = None
        return signalled

    def kill(self) -> None:
        """Kill the engine at once (SIGKILL to its process group): a crashed peer."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)
            _wait_reaped(self._proc.pid)
            self._proc = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> EngineSession:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
        self._tmp.cleanup()

    # ------------------------------------------------------------------ calls

    def generate(
        self, prompts: Sequence[Prompt], max_tokens: int | None = None, timeout_s: float = 120
    ) -> list[RequestResult]:
        reply = self._call(
            {"op": "generate", "prompts": list(prompts), "max_tokens": max_tokens}, timeout_s
        )
        return [RequestResult(**r) for r in reply["results"]]

    def overwrite_kv(self, value: float = 0.0) -> int:
        """Set every element of the engine's KV cache to ``value``; the elements set."""
        return int(self._call({"op": "overwrite_kv", "value": value}, 60)["elements"])

    def metrics(self) -> str:
        """The engine's Prometheus metrics (text format)."""
        return str(self._call({"op": "metrics"}, 60)["text"])

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self._conn is None:
            raise self._failure("is not running")
        self._conn.send(message)
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        assert self._conn is not None
        try:
            ready = self._conn.poll(timeout_s)
            reply = self._conn.recv() if ready else None
        except (OSError, EOFError):
            reply = None
        if reply is None:
            raise self._failure(f"gave no answer within {timeout_s:.0f} s")
        if "error" in reply:
            raise self._failure(f"failed: {reply['error']}")
        return dict(reply)

    def _failure(self, what: str) -> EngineFailed:
        text = self.log
        errors = [line for line in text.splitlines() if "Error" in line][:8]
        failure = EngineFailed(
            f"{self.name} {what}; first errors:\n" + "\n".join(errors)
            + f"\n--- log tail ---\n{text[-6000:]}"
        )
        failure.log = text
        return failure


# ---------------------------------------------------------------------- child


def _overwrite_kv_caches(worker: Any, value: float) -> int:
    """(Runs in the vLLM worker.) Fill every KV cache tensor with ``value``."""
    count = 0
    for cache in worker.model_runner.kv_caches:
        cache.fill_(value)
        count += cache.numel()
    return count


def _serve(spec_path: str) -> None:
    import traceback

    spec = EngineSpec(**json.loads(Path(spec_path).read_text()))
    host, port = os.environ["KVC_SESSION_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["KVC_SESSION_KEY"]))
    t0 = time.perf_counter()
    llm = build_llm(spec)
    conn.send({"startup_s": time.perf_counter() - t0})
    while True:
        message = conn.recv()
        op = message["op"]
        if op == "stop":
            break
        try:
            if op == "generate":
                max_tokens = message["max_tokens"] or spec.max_tokens
                conn.send({"results": generate(llm, message["prompts"], max_tokens)})
            elif op == "overwrite_kv":
                counts = llm.collective_rpc(_overwrite_kv_caches, args=(message["value"],))
                conn.send({"elements": sum(counts)})
            elif op == "metrics":
                from prometheus_client import REGISTRY, generate_latest

                conn.send({"text": generate_latest(REGISTRY).decode()})
            else:
                conn.send({"error": f"unknown op {op!r}"})
        except Exception:
            conn.send({"error": traceback.format_exc()})
    from composer.testing.engine import SHUTDOWN_GRACE_S

    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
    conn.send({"stopped": True})
    conn.close()


if __name__ == "__main__":
    _serve(sys.argv[1])
    # vLLM's engine processes are torn down with ours; don't wait on atexit hooks.
    os._exit(0)
