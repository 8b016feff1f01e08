"""Asking an ``lmcache server`` over the network: healthy, what it runs, and watching it.

:func:`healthy` and :func:`check_server` ask its HTTP frontend (``/healthcheck``,
``/config``): the node checks a server this way before vLLM's connector talks to
it. A :class:`ServerWatcher` probes a server on a daemon thread: a server the
engine started by its pid (:func:`composer.servers.alive`), a given one with
:func:`http_probe` or :func:`tcp_probe`.

Nothing here imports torch, vLLM or LMCache.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from kvc_lmcache.server_errors import ServerDoesNotFit, ServerUnreachable

#: Seconds between liveness probes: a dead server is noticed within about two.
WATCH_INTERVAL = 0.5
#: A network probe waits at most this long; a dead loopback server refuses at once.
PROBE_TIMEOUT = 1.0


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback/config URL
        return json.loads(response.read().decode())


def healthy(http_url: str, timeout: float = 2.0) -> bool:
    try:
        return bool(get_json(f"{http_url}/healthcheck", timeout).get("status") == "healthy")
    except (OSError, ValueError, urllib.error.URLError):
        return False


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
        raise ServerUnreachable(f"LMCache server at {http_url} is not healthy (GET /healthcheck)")
    try:
        mp = get_json(f"{http_url}/config", timeout)["mp"]
    except (OSError, ValueError, KeyError, urllib.error.URLError) as exc:
        raise ServerUnreachable(
            f"cannot read the LMCache server's config at {http_url}/config: {exc}"
        ) from exc
    chunk = int(mp.get("chunk_size", 0))
    if block_size and chunk % block_size:
        raise ServerDoesNotFit(
            f"the LMCache server's chunk size {chunk} is not a multiple of vLLM's block size "
            f"{block_size}: start the server with --chunk-size a multiple of {block_size}"
        )
    supported = str(mp.get("supported_transfer_mode", "lmcache_driven"))
    if supported != "auto" and transfer_mode != "auto" and supported != transfer_mode:
        raise ServerDoesNotFit(
            f"the LMCache server supports transfer mode {supported}, but the connector uses "
            f"{transfer_mode}: set server.transfer_mode: {supported}, or start the server with "
            f"--supported-transfer-mode {transfer_mode} (or auto)"
        )
    if transfer_mode == "auto" and supported == "lmcache_driven":
        # On CPU the worker's auto resolves to engine_driven, which this server refuses.
        raise ServerDoesNotFit(
            "server.transfer_mode: auto may resolve to engine_driven, but the LMCache server "
            "supports only lmcache_driven: set server.transfer_mode: lmcache_driven, or start "
            "the server with --supported-transfer-mode auto"
        )
    return dict(mp)


# -- liveness ------------------------------------------------------------------ #


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
