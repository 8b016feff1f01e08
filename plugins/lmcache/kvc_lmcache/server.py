"""A local ``lmcache server`` child process: loopback, free ports, health-checked, always stopped.

vLLM creates the connector twice per engine, in different processes (the
worker-side one first, while KV caches are set up; the scheduler-side one in
EngineCore after that), and both must talk to the *same* server. So a started
server is shared through a small state file keyed by the engine id and node
id, under an ``flock``: the first process to arrive starts it, later ones
attach, and each records itself as a user. The last user to leave stops it.
A started server that dies is started again where it was (:meth:`SharedServer.restart`,
by whichever of the engine's processes notices first; the state file names the new pid).
As safety nets the server dies with the process that started it
(``PR_SET_PDEATHSIG``) and a ``weakref.finalize`` (run at exit) releases it.

Nothing here imports torch, vLLM or LMCache: the server is LMCache's own CLI.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer import Unavailable
from composer.servers import LOOPBACK, free_port
from kvc_lmcache import memory
from kvc_lmcache.sizes import GIB, shown

PR_SET_PDEATHSIG = 1


class ServerError(RuntimeError):
    """The LMCache server could not be started, reached, or does not fit the engine."""


class ServerLeft(ServerError):
    """A started server is not restarted: its starter left (the engine is stopping)."""


class ServerGone(ServerError, Unavailable):
    """The LMCache server died (or stopped answering) while the engine runs: the
    node's store is away (no fault; the chain counts it and keeps the node on)."""


@dataclass(frozen=True)
class ServerSettings:
    """What a started server is given on its command line."""

    chunk_size: int
    l1_size_gb: float = 1.0
    eviction_policy: str = "LRU"
    #: --supported-transfer-mode of the server.
    transfer_mode: str = "auto"
    extra_args: tuple[str, ...] = ()
    #: What the server runs under (``numactl ...``); it execs the server.
    command_prefix: tuple[str, ...] = ()
    startup_timeout: float = 120.0
    #: More environment for the server (L2 credentials: kept off its argv and out of repr).
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)


@dataclass
class ServerInfo:
    host: str
    port: int
    http_port: int | None
    pid: int | None = None
    log_file: str | None = None
    users: list[str] = field(default_factory=list)
    #: The user (``SharedServer.token``) that started it: the server dies with its process.
    starter: str | None = None

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def http_url(self) -> str | None:
        return None if self.http_port is None else f"http://{self.host}:{self.http_port}"


def lmcache_command() -> list[str]:
    """The ``lmcache`` CLI of this environment (beside the running interpreter first)."""
    beside = Path(sys.executable).parent / "lmcache"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("lmcache")
    if found:
        return [found]
    raise ServerError("the `lmcache` command is not installed (pip install lmcache==0.5.6)")


def server_argv(settings: ServerSettings, host: str, port: int, http_port: int) -> list[str]:
    return [
        *settings.command_prefix, *lmcache_command(), "server",
        "--host", host, "--port", str(port),
        "--http-host", host, "--http-port", str(http_port),
        "--chunk-size", str(settings.chunk_size),
        "--l1-size-gb", str(settings.l1_size_gb),
        # Without an eviction policy the server refuses a legacy L1 size.
        "--eviction-policy", settings.eviction_policy,
        "--supported-transfer-mode", settings.transfer_mode,
        *settings.extra_args,
    ]  # fmt: skip


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # If the process that started the server dies (even by SIGKILL), the server
    # gets SIGTERM: a crashed engine never leaves a server behind.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback/config URL
        return json.loads(response.read().decode())


def healthy(http_url: str, timeout: float = 2.0) -> bool:
    try:
        return bool(get_json(f"{http_url}/healthcheck", timeout).get("status") == "healthy")
    except (OSError, ValueError, urllib.error.URLError):
        return False


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == 0


def _is_server(pid: int | None, port: int | None) -> bool:
    """Is ``pid`` still the `lmcache server` on ``port`` recorded in a state file?

    A state file can outlive its server (an engine killed with SIGKILL); its
    pid may since belong to an unrelated process, which must never be signalled.
    """
    if pid is None or not _alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"server" in argv and str(port).encode() in argv and any(b"lmcache" in a for a in argv)


def start_server(
    settings: ServerSettings,
    log_file: Path,
    host: str = LOOPBACK,
    *,
    port: int | None = None,
    http_port: int | None = None,
) -> ServerInfo:
    """Start ``lmcache server`` on free loopback ports; return once it is healthy.

    ``port`` / ``http_port`` pin the ports (a server restarted where clients
    expect it). Raises :class:`ServerError` with the tail of its log if it
    exits or is not healthy within ``settings.startup_timeout`` (and then stops it).
    """
    port = port or free_port(host)
    http_port = http_port or free_port(host)
    while http_port == port:
        http_port = free_port(host)
    argv = server_argv(settings, host, port, http_port)
    env = {
        **os.environ,
        "LMCACHE_DISABLE_BANNER": "1",
        "PYTHONUNBUFFERED": "1",
        **dict(settings.env),
    }
    with log_file.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only a prctl call
        )
    info = ServerInfo(host, port, http_port, pid=proc.pid, log_file=str(log_file))
    deadline = time.monotonic() + settings.startup_timeout
    http_url = info.http_url
    assert http_url is not None
    while True:
        if proc.poll() is not None:
            raise ServerError(
                f"`lmcache server` exited with {proc.returncode} while starting:\n"
                f"{' '.join(argv)}\n{_tail(log_file)}"
            )
        if healthy(http_url, timeout=1.0):
            return info
        if time.monotonic() > deadline:
            stop_pid(proc.pid)
            raise ServerError(
                f"`lmcache server` not healthy at {http_url}/healthcheck after "
                f"{settings.startup_timeout:.0f} s (startup_timeout); log:\n{_tail(log_file)}"
            )
        time.sleep(0.25)


def check_l1_fits(settings: ServerSettings, node_id: str) -> None:
    """Raise :class:`ServerError` when the server's L1 is more than the memory available
    now: it lives in this machine's memory, and LMCache allocates it at start or as it
    fills (then an OOM kill minutes into serving)."""
    size = int(settings.l1_size_gb * GIB)
    memory.check_fits(
        f'lmcache node "{node_id}": server.l1_size_gb {shown(settings.l1_size_gb)} '
        f"({memory.human(size)}, the L1 of the `lmcache server` it starts)",
        size,
        "lower server.l1_size_gb",
        error=ServerError,
    )


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds. Only for servers this module started."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.05)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def state_dir() -> Path:
    path = Path(
        os.environ.get("KVC_LMCACHE_STATE_DIR") or Path(tempfile.gettempdir()) / "kvc-lmcache"
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class SharedServer:
    """One started server per (engine, node), shared by that engine's processes.

    :meth:`acquire` starts it or attaches to it; :meth:`release` leaves it, and
    the last user stops it. Safe to release twice.
    """

    def __init__(self, key: str, settings: ServerSettings, node_id: str = "lmcache") -> None:
        digest = hashlib.sha256(f"{key}|{settings!r}".encode()).hexdigest()[:16]
        root = state_dir()
        self.lock_file = root / f"{digest}.lock"
        self.state_file = root / f"{digest}.json"
        self.log_file = root / f"{digest}.log"
        self.settings = settings
        #: The node that starts it, named in its errors.
        self.node_id = node_id
        self.token = f"{os.getpid()}:{id(self)}"
        self.info: ServerInfo | None = None
        self.started = False
        self._finalizer: weakref.finalize[Any, SharedServer] | None = None

    def acquire(self) -> ServerInfo:
        with _locked(self.lock_file):
            info = self._read()
            if info is not None and _alive(info.pid) and info.http_url and healthy(info.http_url):
                info.users = [u for u in info.users if _alive(int(u.split(":")[0]))]
            else:
                if info is not None and _is_server(info.pid, info.port):
                    stop_pid(info.pid)  # type: ignore[arg-type]  # ours, but no longer healthy
                check_l1_fits(self.settings, self.node_id)
                info = start_server(self.settings, self.log_file)
                info.starter = self.token
                self.started = True
            info.users.append(self.token)
            self._write(info)
        self.info = info
        self._finalizer = weakref.finalize(
            self, _release, self.lock_file, self.state_file, self.token
        )
        return info

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def pid(self) -> int | None:
        """The server's pid now (a restart by the engine's other process changes it)."""
        info = self._read()
        return info.pid if info is not None else None

    def restart(self) -> tuple[ServerInfo, bool]:
        """Start the server again on its ports, unless the engine's other process
        already has: the live server's info, and whether this call started it.
        Raises :class:`ServerError` if it does not come up (the caller tries again
        later), or :class:`ServerLeft` if it died because the process that started
        it left (its engine is shutting down: nothing to restart for).
        """
        with _locked(self.lock_file):
            info = self._read()
            if info is None:
                raise ServerLeft("the server was released: nothing to restart")
            if _alive(info.pid) and info.http_url and healthy(info.http_url):
                return info, False
            if info.starter is not None and info.starter not in info.users:
                raise ServerLeft("the process that started it has left: the engine is stopping")
            if _is_server(info.pid, info.port):
                stop_pid(info.pid)  # type: ignore[arg-type]  # ours, but no longer healthy
            check_l1_fits(self.settings, self.node_id)
            # Started from a thread that lives as long as this process (PR_SET_PDEATHSIG
            # stops the server when the thread that started it ends), not the caller's.
            new = _STARTER.submit(
                start_server,
                self.settings,
                self.log_file,
                info.host,
                port=info.port,
                http_port=info.http_port,
            ).result()
            new.users, new.starter = info.users, self.token
            self._write(new)
        self.info = new
        return new, True

    def _read(self) -> ServerInfo | None:
        try:
            return ServerInfo(**json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _write(self, info: ServerInfo) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info.__dict__))
        tmp.replace(self.state_file)


#: The one thread that starts servers again (see ``SharedServer.restart``).
_STARTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-lmcache-starter")


def _release(lock_file: Path, state_file: Path, token: str) -> None:
    """Leave the server; stop it when no live user remains (also run at exit)."""
    with _locked(lock_file):
        try:
            data = json.loads(state_file.read_text())
        except (OSError, ValueError):
            return
        users = [u for u in data.get("users", []) if u != token and _alive(int(u.split(":")[0]))]
        if users:
            data["users"] = users
            state_file.write_text(json.dumps(data))
            return
        if _is_server(data.get("pid"), data.get("port")):
            stop_pid(int(data["pid"]))
        with contextlib.suppress(OSError):
            state_file.unlink()


def check_server(
    http_url: str,
    *,
    block_size: int | None,
    transfer_mode: str,
    timeout: float = 5.0,
) -> dict[str, Any]:
    """Check a server before vLLM's connector talks to it: healthy, chunk size, transfer mode.

    A mismatch in transfer mode otherwise makes the worker wait the whole
    mq_timeout and fail with "did not respond to register_kv_caches".
    Returns the server's ``mp`` config.
    """
    if not healthy(http_url, timeout):
        raise ServerError(f"LMCache server at {http_url} is not healthy (GET /healthcheck)")
    try:
        mp = get_json(f"{http_url}/config", timeout)["mp"]
    except (OSError, ValueError, KeyError, urllib.error.URLError) as exc:
        raise ServerError(
            f"cannot read the LMCache server's config at {http_url}/config: {exc}"
        ) from exc
    chunk = int(mp.get("chunk_size", 0))
    if block_size and chunk % block_size:
        raise ServerError(
            f"the LMCache server's chunk size {chunk} is not a multiple of vLLM's block size "
            f"{block_size}: start the server with --chunk-size a multiple of {block_size}"
        )
    supported = str(mp.get("supported_transfer_mode", "lmcache_driven"))
    if supported != "auto" and transfer_mode != "auto" and supported != transfer_mode:
        raise ServerError(
            f"the LMCache server supports transfer mode {supported}, but the connector uses "
            f"{transfer_mode}: set server.transfer_mode: {supported}, or start the server with "
            f"--supported-transfer-mode {transfer_mode} (or auto)"
        )
    if transfer_mode == "auto" and supported == "lmcache_driven":
        # On CPU the worker's auto resolves to engine_driven, which this server refuses.
        raise ServerError(
            "server.transfer_mode: auto may resolve to engine_driven, but the LMCache server "
            "supports only lmcache_driven: set server.transfer_mode: lmcache_driven, or start "
            "the server with --supported-transfer-mode auto"
        )
    return dict(mp)


# -- liveness ------------------------------------------------------------------ #

#: Seconds between liveness probes: a dead server is noticed within about two.
WATCH_INTERVAL = 0.5
#: A network probe waits at most this long; a dead loopback server refuses at once.
PROBE_TIMEOUT = 1.0


def running(pid: int | None) -> bool:
    """Liveness of a server this engine started: its process runs (exact, no network).

    The engine's other process (not the server's parent) sees a killed server
    as a zombie until its parent reaps it: that counts as dead too.
    """
    if not _alive(pid):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: signal 0 is all there is
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def http_probe(http_url: str, timeout: float = PROBE_TIMEOUT) -> Callable[[], bool]:
    """Liveness of a given server with an HTTP frontend: ``GET /healthcheck``."""
    return lambda: healthy(http_url, timeout)


def tcp_probe(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> Callable[[], bool]:
    """Liveness of a given server without an HTTP frontend: its ZMQ port accepts a connection."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError:
            return False

    return probe


class ServerWatcher:
    """Probes a server every ``interval`` seconds on a daemon thread.

    ``alive`` is a plain attribute (one read on a hot path). ``on_change(alive)``
    runs on the watcher thread on every transition: down after ``failures``
    failed probes in a row (1 for an exact probe such as a pid, more for a
    network one, so one slow answer on a busy machine is not an outage), up
    after one good probe. ``on_tick(alive)`` runs after every probe.
    Callback errors are swallowed: the watcher must outlive them.
    """

    def __init__(
        self,
        probe: Callable[[], bool],
        *,
        interval: float = WATCH_INTERVAL,
        failures: int = 1,
        on_change: Callable[[bool], None] | None = None,
        on_tick: Callable[[bool], None] | None = None,
        name: str = "kvc-lmcache-watch",
    ) -> None:
        self.probe = probe
        self.interval = interval
        self.failures = max(1, failures)
        self.on_change = on_change
        self.on_tick = on_tick
        self.alive = True
        self.changes = 0
        self._failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> ServerWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # A probe waits at most PROBE_TIMEOUT; never hold shutdown longer than that.
            self._thread.join(timeout=self.interval + PROBE_TIMEOUT + 1.0)

    def check(self) -> bool:
        """Probe once now (on the caller's thread); updates ``alive`` like a tick."""
        try:
            ok = bool(self.probe())
        except Exception:
            ok = False
        if ok:
            self._failed = 0
        else:
            self._failed += 1
        alive = ok or (self.alive and self._failed < self.failures)
        if alive != self.alive:
            self.alive = alive
            self.changes += 1
            self._call(self.on_change, alive)
        self._call(self.on_tick, alive)
        return alive

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    @staticmethod
    def _call(callback: Callable[[bool], None] | None, alive: bool) -> None:
        if callback is None:
            return
        try:
            callback(alive)
        except Exception:
            logging.getLogger(__name__).exception("lmcache server watcher callback failed")
