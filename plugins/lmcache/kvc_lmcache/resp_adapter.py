"""LMCache's RESP L2 adapter, reconnecting: loaded inside ``lmcache server`` (type ``plugin``).

LMCache 0.5.6's native RESP client (``lmcache.lmcache_redis.LMCacheRedisClient``)
opens one socket per worker when it is created and never opens another: once
its Valkey/Redis server restarts (or a connection drops), every operation
fails with "socket writev failed" until the ``lmcache server`` itself is
restarted. And it raises when the store is down at creation, so the server
does not start at all. A fleet's shared tier must survive its store going
away and coming back, without restarting anything else.

:class:`ReconnectingRespClient` keeps LMCache's native client (its pipelined C++
I/O is the fast path) behind the interface ``NativeConnectorL2Adapter``
expects, with one stable eventfd and its own future ids. When an operation
fails for a connection reason, the client is marked broken: operations fail at
once (nothing is sent to a dead socket; the misses are recomputed by vLLM) and,
at most every ``RETRY_S`` seconds, a ``PING`` from its own thread (no
operation ever waits on it) checks the store; once it answers, a new native
client replaces the old one. :class:`ReconnectingRespL2Adapter`
is LMCache's own ``NativeConnectorL2Adapter`` over that client.

This module imports LMCache (and so torch): only the server process loads it.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
    NativeConnectorL2Adapter,
)

from composer.servers import ping

#: Seconds between two reconnection attempts while the store is unreachable: a
#: PING each, so a store back is used again within about this long.
RETRY_S = 0.25
#: Error texts of LMCache's native client that mean the connection is gone.
CONNECTION_ERRORS = ("socket", "connection", "connect", "closed", "broken")

Completion = tuple[int, bool, str, Any]


class ReconnectingRespClient:
    """A native RESP client that is replaced by a new one after its connection is lost."""

    def __init__(self, connect: Callable[[], Any], ping: Callable[[], bool]) -> None:
        self._connect = connect
        self._ping = ping
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._queue: list[Completion] = []
        self._next_id = 1
        #: native future id -> our id, for the current native client.
        self._ids: dict[int, int] = {}
        self._native: Any = None
        self._last_attempt = 0.0
        self.reconnects = 0
        self.failed_fast = 0
        #: Operations that completed with a failure (any reason).
        self.errors = 0
        self._stop = threading.Event()
        self._native = self._connect_if_up()
        self._last_attempt = time.monotonic()
        self._thread = threading.Thread(target=self._forward, daemon=True, name="kvc-resp-forward")
        self._thread.start()

    # -- the interface NativeConnectorL2Adapter uses ------------------------------ #

    def event_fd(self) -> int:
        return self._efd

    def submit_batch_get(self, keys: list[str], bufs: list[memoryview]) -> int:
        return self._submit("submit_batch_get", keys, bufs)

    def submit_batch_set(self, keys: list[str], bufs: list[memoryview]) -> int:
        return self._submit("submit_batch_set", keys, bufs)

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit("submit_batch_exists", keys)

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit("submit_batch_delete", keys)

    def drain_completions(self) -> list[Completion]:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        with self._lock:
            out, self._queue = self._queue, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            native, self._native = self._native, None
        if native is not None:
            native.close()
        os.close(self._efd)

    @property
    def connected(self) -> bool:
        return self._native is not None

    # -- internals ------------------------------------------------------------- #

    def _submit(self, method: str, *args: Any) -> int:
        with self._lock:
            ours = self._next_id
            self._next_id += 1
            if self._native is None:
                # The store is unreachable: fail now instead of on a dead socket.
                self.failed_fast += 1
                self._complete_locked(ours, False, "kvc: the RESP store is unreachable", None)
                return ours
            try:
                native_id = int(getattr(self._native, method)(*args))
            except Exception as exc:  # the native client refused the submission
                self._broken_locked()
                self._complete_locked(ours, False, f"kvc: {exc}", None)
                return ours
            self._ids[native_id] = ours
            return ours

    def _complete_locked(self, ours: int, ok: bool, error: str, result: Any) -> None:
        if not ok:
            self.errors += 1
        self._queue.append((ours, ok, error, result))
        os.eventfd_write(self._efd, 1)

    def _broken_locked(self) -> None:
        """Drop the native client; its pending operations fail now."""
        native, self._native = self._native, None
        for ours in self._ids.values():
            self._complete_locked(ours, False, "kvc: RESP connection lost", None)
        self._ids = {}
        if native is not None:
            # Its sockets are dead: closing returns at once. On its own thread
            # all the same, so that a hung close never blocks a submission.
            threading.Thread(target=native.close, daemon=True).start()

    def _connect_if_up(self) -> Any:
        """A new native client if the store answers PING, else None (no lock held)."""
        # LMCache's client does not fail when the store is down: it logs and
        # keeps dead sockets. Ask the store first.
        if not self._ping():
            return None
        try:
            return self._connect()
        except Exception:
            return None

    def _reconnect(self) -> None:
        """On the forwarding thread, so that no submission waits on a PING or a connect."""
        now = time.monotonic()
        if now - self._last_attempt < RETRY_S:
            self._stop.wait(0.05)
            return
        self._last_attempt = now
        native = self._connect_if_up()
        if native is None:
            return
        with self._lock:
            self._native = native
            self.reconnects += 1

    def _forward(self) -> None:
        """Move the native client's completions to our queue, under our ids."""
        while not self._stop.is_set():
            native = self._native
            if native is None:
                self._reconnect()
                continue
            try:
                ready, _, _ = select.select([native.event_fd()], [], [], 0.2)
            except (OSError, ValueError):
                continue
            if not ready:
                continue
            try:
                completions = native.drain_completions()
            except Exception:
                continue
            with self._lock:
                if native is not self._native:
                    continue  # replaced meanwhile: its operations were failed already
                lost = False
                for native_id, ok, error, result in completions:
                    ours = self._ids.pop(int(native_id), None)
                    if ours is None:
                        continue
                    if not ok and any(word in str(error).lower() for word in CONNECTION_ERRORS):
                        lost = True
                    self._complete_locked(ours, bool(ok), str(error), result)
                if lost:
                    self._broken_locked()


class ReconnectingRespL2Adapter(NativeConnectorL2Adapter):
    """LMCache's native-connector L2 adapter over a :class:`ReconnectingRespClient`.

    ``adapter_params`` (from ``server.l2: [{type: resp}]``): host, port,
    num_workers, max_capacity_gb. Credentials come from the server's
    environment, as for LMCache's own RESP adapter: LMCACHE_RESP_USERNAME,
    LMCACHE_RESP_PASSWORD.
    """

    def __init__(self, params: dict[str, Any], **_: Any) -> None:
        from lmcache.lmcache_redis import LMCacheRedisClient

        host = str(params["host"])
        port = int(params["port"])
        workers = int(params.get("num_workers", 8))
        username = os.environ.get("LMCACHE_RESP_USERNAME", "")
        password = os.environ.get("LMCACHE_RESP_PASSWORD", "")
        self._resp = ReconnectingRespClient(
            lambda: LMCacheRedisClient(host, port, workers, username, password),
            lambda: ping(host, port, password=password, username=username),
        )
        super().__init__(
            self._resp,
            max_capacity_gb=float(params.get("max_capacity_gb", 0)),
            type_name="resp",
            extra_status={"host": host, "port": port, "num_workers": workers},
        )

    def report_status(self) -> dict[str, Any]:
        status = super().report_status()
        status.update(
            connected=self._resp.connected,
            reconnects=self._resp.reconnects,
            failed_fast=self._resp.failed_fast,
            errors=self._resp.errors,
        )
        return status
