"""One started ``lmcache server`` per (engine, node), shared by the engine's processes.

vLLM creates the connector twice per engine, in different processes (the
worker-side one first, while KV caches are set up; the scheduler-side one in
EngineCore after that), and both must talk to the *same* server. So a started
server is shared through a small state file keyed by the engine id and node
id, under an ``flock``: the first process to arrive starts it
(:func:`kvc_lmcache.server_process.start_server`), later ones attach, and each
records itself as a user. The last user to leave stops it. A started server
that dies is started again where it was (:meth:`SharedServer.restart`, by
whichever of the engine's processes notices first; the state file names the
new pid). As safety nets the server dies with the process that started it
(``PR_SET_PDEATHSIG``) and a ``weakref.finalize`` (run at exit) releases it.

Nothing here imports torch, vLLM or LMCache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from composer.servers import alive, stop_process
from kvc_lmcache.server_errors import ServerReleased
from kvc_lmcache.server_health import healthy
from kvc_lmcache.server_process import (
    ServerInfo,
    ServerSettings,
    check_l1_fits,
    is_lmcache_server,
    start_server,
)


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
            if info is not None and alive(info.pid) and info.http_url and healthy(info.http_url):
                info.users = [u for u in info.users if alive(int(u.split(":")[0]))]
            else:
                if info is not None and is_lmcache_server(info.pid, info.port):
                    stop_process(info.pid)  # type: ignore[arg-type]  # ours, but no longer healthy
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
        Raises :class:`~kvc_lmcache.server_errors.ServerDidNotStart` (or
        ``ServerDoesNotFit``, its L1 in the memory left) if it does not come up (the
        caller tries again later), or :class:`~kvc_lmcache.server_errors.ServerReleased`
        if it died because the process that started it left (its engine is shutting
        down: nothing to restart for).
        """
        with _locked(self.lock_file):
            info = self._read()
            if info is None:
                raise ServerReleased("the server was released: nothing to restart")
            if alive(info.pid) and info.http_url and healthy(info.http_url):
                return info, False
            if info.starter is not None and info.starter not in info.users:
                raise ServerReleased("the process that started it has left: the engine is stopping")
            if is_lmcache_server(info.pid, info.port):
                stop_process(info.pid)  # type: ignore[arg-type]  # ours, but no longer healthy
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
        users = [u for u in data.get("users", []) if u != token and alive(int(u.split(":")[0]))]
        if users:
            data["users"] = users
            state_file.write_text(json.dumps(data))
            return
        if is_lmcache_server(data.get("pid"), data.get("port")):
            stop_process(int(data["pid"]))
        with contextlib.suppress(OSError):
            state_file.unlink()
