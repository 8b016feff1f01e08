"""Starting an ``lmcache server``: its command line, the child process, its checks.

:func:`start_server` starts one on free loopback ports (or the ports it had) as a
child process (:func:`composer.servers.spawn`): its output in a log file, and
SIGTERM from the kernel when the thread that started it ends
(``PR_SET_PDEATHSIG``), so a crashed engine never leaves a server behind. It
returns once the server's HTTP frontend says it is healthy. Sharing one server
between an engine's processes is :mod:`kvc_lmcache.server_sharing`.

Nothing here imports torch, vLLM or LMCache: the server is LMCache's own CLI.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from composer.servers import LOOPBACK, alive, free_port, spawn, stop_process, tail
from kvc_lmcache import memory
from kvc_lmcache.server_errors import ServerDidNotStart, ServerDoesNotFit
from kvc_lmcache.server_health import healthy
from kvc_lmcache.sizes import GIB, shown


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
    raise ServerDidNotStart("the `lmcache` command is not installed (pip install lmcache==0.5.6)")


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


def is_lmcache_server(pid: int | None, port: int | None) -> bool:
    """Is ``pid`` still the `lmcache server` on ``port`` recorded in a state file?

    A state file can outlive its server (an engine killed with SIGKILL); its
    pid may since belong to an unrelated process, which must never be signalled.
    """
    if pid is None or not alive(pid):
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
    expect it). Raises :class:`ServerDidNotStart` with the tail of its log if it
    exits or is not healthy within ``settings.startup_timeout`` (and then stops it).
    It stays in the process group of the process that starts it.
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
    proc = spawn(argv, log_file, env=env, append=True, new_group=False, die_with_parent=True)
    info = ServerInfo(host, port, http_port, pid=proc.pid, log_file=str(log_file))
    deadline = time.monotonic() + settings.startup_timeout
    http_url = info.http_url
    assert http_url is not None
    while True:
        if proc.poll() is not None:
            raise ServerDidNotStart(
                f"`lmcache server` exited with {proc.returncode} while starting:\n"
                f"{' '.join(argv)}\n{tail(log_file)}"
            )
        if healthy(http_url, timeout=1.0):
            return info
        if time.monotonic() > deadline:
            stop_process(proc)
            raise ServerDidNotStart(
                f"`lmcache server` not healthy at {http_url}/healthcheck after "
                f"{settings.startup_timeout:.0f} s (startup_timeout); log:\n{tail(log_file)}"
            )
        time.sleep(0.25)


def check_l1_fits(settings: ServerSettings, node_id: str) -> None:
    """Raise :class:`ServerDoesNotFit` when the server's L1 is more than the memory available
    now: it lives in this machine's memory, and LMCache allocates it at start or as it
    fills (then an OOM kill minutes into serving)."""
    size = int(settings.l1_size_gb * GIB)
    memory.check_fits(
        f'lmcache node "{node_id}": server.l1_size_gb {shown(settings.l1_size_gb)} '
        f"({memory.human(size)}, the L1 of the `lmcache server` it starts)",
        size,
        "lower server.l1_size_gb",
        error=ServerDoesNotFit,
    )
