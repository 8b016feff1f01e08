"""The server node's supervision of its LMCache server: watch, restart, L2 health, resume.

One :class:`ServerSupervisor` per server node (in each of the engine's
processes) probes the server on a :class:`~kvc_lmcache.server_health.ServerWatcher`
thread. When the server dies it puts LMCache in its degraded mode at once and
ends the waits on it (:mod:`kvc_lmcache.lmcache_internals`), lowers
:attr:`ServerSupervisor.alive` (the flag the node's hooks read), and restarts a
server the engine started, with backoff; when the server answers again it
wakes LMCache's heartbeat and raises the flag once LMCache has re-registered.
Every few probes it reads a started server's L2 counters and tells an L2
outage from them (:mod:`kvc_lmcache.l2_stats`). The plugin's README (*A server
that dies*, *An L2 tier that fails*) says what each step costs and why.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from composer.servers import alive
from kvc_lmcache import l2_stats
from kvc_lmcache.config import ServerConfig
from kvc_lmcache.lmcache_internals import (
    degrade,
    fail_pending,
    lmcache_healthy,
    wake_heartbeats,
)
from kvc_lmcache.server_errors import LMCacheServerError, ServerReleased
from kvc_lmcache.server_health import PROBE_TIMEOUT, ServerWatcher, get_json, http_probe, tcp_probe
from kvc_lmcache.server_process import ServerInfo
from kvc_lmcache.server_sharing import SharedServer

#: Seconds before the second try to restart a started server that died; doubled
#: for each later try (the first is at once).
RESTART_BACKOFF_S = 1.0
#: Seconds the watcher waits, once the server answers again, for LMCache's woken
#: heartbeat to re-register (then the next tick checks again).
RESUME_WAIT_S = 0.5
#: Watcher ticks (WATCH_INTERVAL each) between two reads of the server's L2 metrics.
L2_SCRAPE_TICKS = 4
#: Seconds the watcher waits, once the server runs again, for its own restart
#: call to return (it writes the new pid just before).
RESTART_SETTLE_S = 1.0
#: Restarts run here, not on the watcher thread: its ticks go on ending every
#: wait on the dead server while a new one starts (seconds).
_RESTARTS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-lmcache-restart")


class ServerSupervisor:
    """Watches one node's LMCache server (started, ``shared``, or given) and its L2 tiers.

    ``connector`` is the node's LMCache connector, ``gauges`` the node's gauges
    (the supervisor owns ``server_alive``, ``server_outages``, ``server_restarts``,
    ``server_restart_failures`` and the ``l2_*`` ones), ``log`` the node's logger.
    """

    def __init__(
        self,
        *,
        connector: Any,
        server: ServerInfo,
        shared: SharedServer | None,
        config: ServerConfig,
        gauges: MutableMapping[str, float],
        log: Any,
        process: str,
        node_id: str,
    ) -> None:
        self.connector = connector
        #: The server now: a restart changes its pid.
        self.server = server
        self.shared = shared
        self.config = config
        self.gauges = gauges
        self.log = log
        self.process = process
        #: Read at the top of every node hook that would reach the server.
        self.alive = True
        #: Outages seen by this process.
        self.down_events = 0
        #: Tries to restart the started server in this outage, when the next is
        #: due, and the one under way.
        self._restart_tries = 0
        self._restart_at = 0.0
        self._restarting: Future[tuple[ServerInfo, bool]] | None = None
        self._restart_t0 = 0.0
        # Written by the watcher thread while the chain reads them: gauges that
        # exist from the start only change value, never the dict's size.
        self.gauges["server_alive"] = 1
        self.gauges["server_outages"] = 0
        self.gauges["server_restarts"] = 0
        self.gauges["server_restart_failures"] = 0
        #: time.monotonic() when the current (or last) outage began.
        self.down_since = 0.0
        #: time.monotonic() when the server last answered again after an outage,
        #: and when the node resumed (LMCache re-registered with it) after that.
        self.back_at: float | None = None
        self.resumed_at: float | None = None
        self._lock = threading.Lock()
        #: The started server's L2 tiers: their work and failures, from its /metrics,
        #: and their outages, told from those.
        self.l2_tiers = len(config.l2) if shared is not None else 0
        self.l2_health = l2_stats.L2Health()
        self._ticks = 0
        if self.l2_tiers:
            self.gauges["l2_adapters"] = self.l2_tiers
            for gauge in l2_stats.GAUGES:
                self.gauges[gauge] = 0
            self.gauges["l2_serving"] = 1
            self.gauges["l2_outages"] = 0
        self.watcher = self._make_watcher(node_id)

    def start(self) -> ServerSupervisor:
        self.watcher.start()
        return self

    def stop(self) -> bool:
        """Stop watching (at the node's shutdown); whether the server still answers.

        No second chance for a network probe here: one unanswered probe is
        reason enough not to wait on the server.
        """
        self.watcher.stop()
        try:
            answers = bool(self.watcher.probe())
        except Exception:
            answers = False
        alive = self.alive and answers
        if self.alive and not answers:
            self._changed(False)
        if alive:
            self.scrape_l2()
        return alive

    def _make_watcher(self, node_id: str) -> ServerWatcher:
        name = f"kvc-lmcache-watch-{node_id}"
        shared = self.shared
        if shared is not None:
            # Started by this engine: its pid is exact (read each time: a restart
            # by the engine's other process changes it).
            return ServerWatcher(
                lambda: alive(shared.pid()),
                on_change=self._changed,
                on_tick=self._tick,
                name=name,
            )
        http_url = self.config.http_url
        probe = (
            http_probe(http_url.rstrip("/"))
            if http_url
            else tcp_probe(self.server.host, self.server.port)
        )
        # Two failed probes in a row: one slow answer on a busy host is no outage.
        return ServerWatcher(
            probe, failures=2, on_change=self._changed, on_tick=self._tick, name=name
        )

    # -- the watcher's callbacks --------------------------------------------------- #

    def _changed(self, alive: bool) -> None:
        if alive:
            self._came_back()
        else:
            self._went_down()

    def _went_down(self) -> None:
        with self._lock:
            # LMCache's own degraded mode first, then the flag: a hook that sees
            # the flag down finds LMCache no longer talking to the server.
            degrade(self.connector)
            fail_pending(self.connector, self.server.url)
            self.alive = False
            self.down_events += 1
            self.down_since = time.monotonic()
            self._restart_tries = 0
            self._restart_at = self.down_since
        # A server started again counts its L2 work from 0.
        self.l2_health.new_server()
        self.gauges["server_alive"] = 0
        self.gauges["server_outages"] = self.down_events
        owned = self.shared is not None
        self.log.warning(
            "LMCache server is down: lookups miss, loads are recomputed, saves are skipped "
            + ("until it is restarted" if owned else "until it answers again"),
            url=self.server.url,
            http=self.server.http_url or self.config.http_url,
            pid=self.server.pid,
            process=self.process,
            owned=owned,
        )

    def _came_back(self) -> None:
        restarting = self._restarting
        if restarting is not None:
            concurrent.futures.wait([restarting], timeout=RESTART_SETTLE_S)
            self._restart_settled()
        shared = self.shared
        if shared is not None and self._restarting is None:
            # Started again by the engine's other process while this one had
            # no restart under way (its tries spent, or the next not due yet):
            # take its pid, or the next tick would take the new pid for a
            # restart between two probes and count a second outage.
            pid = shared.pid()
            if pid is not None and pid != self.server.pid:
                self.server = dataclasses.replace(self.server, pid=pid)
        # Requests sent during the outage went to the dead server (or were
        # lost with its connection): none will be answered. End their waits
        # before LMCache talks to the new one.
        if not lmcache_healthy(self.connector):
            fail_pending(self.connector, self.server.url)
        # Back: LMCache's own heartbeat re-registers the KV caches and ends
        # its degraded mode, woken now instead of at its next interval;
        # _tick resumes once it has.
        self.back_at = time.monotonic()
        wake_heartbeats(self.connector)
        self.log.info("LMCache server answers again", url=self.server.url)
        # Resume as soon as the woken heartbeat has re-registered, not a tick later.
        deadline = self.back_at + RESUME_WAIT_S
        while not self._resume_if_healthy() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _tick(self, alive: bool) -> None:
        self._ticks += 1
        if alive and self._ticks % L2_SCRAPE_TICKS == 0:
            self.scrape_l2()
        if not alive:
            # Requests LMCache sent since the last tick (a store it began before
            # it was degraded sends its second half after) would each wait out
            # mq_timeout: end those waits now, every tick of the outage, also
            # while a restart is under way. Only while LMCache is degraded: a
            # healthy adapter reads a failed future's result and raises.
            if not lmcache_healthy(self.connector):
                fail_pending(self.connector, self.server.url)
            self._restart_due()
            return
        self._restart_settled()
        shared = self.shared
        if shared is not None and self.alive:
            pid = shared.pid()
            if pid is not None and pid != self.server.pid:
                # Restarted by the engine's other process between two probes:
                # LMCache must register with the new server, which only its
                # heartbeat's way back from degraded mode does.
                self.log.warning("LMCache server was restarted", pid=pid, was=self.server.pid)
                self.server = dataclasses.replace(self.server, pid=pid)
                self._went_down()
                self._came_back()
                return
        self._resume_if_healthy()

    # -- restarts of a started server --------------------------------------------- #

    def _restart_due(self) -> None:
        """Start a restart of the started server if a try is due, or settle the one
        under way (on the watcher thread; the restart itself runs on ``_RESTARTS``,
        and the server is started from a thread that lives as long as the process)."""
        shared, limit = self.shared, self.config.restarts
        if shared is None:
            return
        if self._restarting is not None:
            self._restart_settled()
            return
        if self._restart_tries >= limit or time.monotonic() < self._restart_at:
            return
        self._restart_tries += 1
        self._restart_t0 = time.perf_counter()
        self._restarting = _RESTARTS.submit(shared.restart)

    def _restart_settled(self) -> None:
        """Take the result of a restart that has returned; nothing if none has."""
        future, limit = self._restarting, self.config.restarts
        if future is None or not future.done():
            return
        self._restarting = None
        seconds = round(time.perf_counter() - self._restart_t0, 2)
        try:
            info, restarted = future.result()
        except ServerReleased as exc:
            self._restart_tries = limit  # for good: the engine is stopping
            self.log.info("LMCache server not restarted", reason=str(exc))
            return
        except LMCacheServerError as exc:
            self._restart_failed(exc)
            return
        self.server = info
        if restarted:  # (else the engine's other process restarted it first)
            self.gauges["server_restarts"] += 1
        self.log.warning(
            "LMCache server restarted" if restarted else "LMCache server restarted elsewhere",
            url=info.url,
            pid=info.pid,
            tries=self._restart_tries,
            seconds=seconds,
            process=self.process,
        )

    def _restart_failed(self, exc: LMCacheServerError) -> None:
        limit = self.config.restarts
        last = self._restart_tries >= limit
        backoff = RESTART_BACKOFF_S * 2 ** (self._restart_tries - 1)
        self._restart_at = time.monotonic() + backoff
        self.gauges["server_restart_failures"] += 1
        self.log.error(
            "LMCache server restart failed"
            + ("; no tries left: its store stays away until vLLM restarts" if last else ""),
            tries=self._restart_tries,
            limit=limit,
            error=str(exc).splitlines()[0],
        )

    # -- resuming ------------------------------------------------------------------ #

    def _resume_if_healthy(self) -> bool:
        """Resume once LMCache is out of its degraded mode; True if the node is on."""
        if self.alive:
            return True
        if not lmcache_healthy(self.connector):
            return False
        if self.process == "scheduler" and not self._worker_registered():
            # A restarted server answers lookups only once the engine's worker
            # half has registered its KV caches again; asked earlier, a lookup
            # waits out mq_timeout. (The worker half is healthy only once it has.)
            return False
        with self._lock:
            self.alive = True
            self.resumed_at = time.monotonic()
        self.gauges["server_alive"] = 1
        self.log.warning(
            "LMCache server is back: resuming",
            url=self.server.url,
            down_s=round(self.resumed_at - self.down_since, 2),
            resume_s=round(self.resumed_at - (self.back_at or self.down_since), 2),
            process=self.process,
        )
        return True

    def _worker_registered(self) -> bool:
        """Whether the server lists a registered worker (its ``/status``); True when
        the server has no HTTP frontend to ask."""
        http_url = self.server.http_url or self.config.http_url
        if not http_url:
            return True
        try:
            status = get_json(f"{http_url.rstrip('/')}/status", timeout=PROBE_TIMEOUT)
        except (OSError, ValueError):
            return False
        return bool(
            status.get("registered_gpu_ids") or status.get("registered_non_cuda_instance_ids")
        )

    # -- L2 health ------------------------------------------------------------------ #

    def scrape_l2(self) -> None:
        """Read the started server's L2 counters now (every L2_SCRAPE_TICKS probes, and
        at shutdown): gauges, and an L2 outage begun or ended."""
        http_url = self.server.http_url
        if not self.l2_tiers or http_url is None:
            return
        counts = l2_stats.scrape(http_url)
        if counts is None:
            return
        # Existing keys only: the chain reads this dict on another thread.
        for gauge, value in counts.items():
            self.gauges[gauge] = value
        change = self.l2_health.observe(counts, time.monotonic())
        if change is None:
            return
        self.gauges["l2_serving"] = int(change.serving)
        self.gauges["l2_outages"] = self.l2_health.outages
        tiers = ", ".join(tier.describe() for tier in self.config.l2)
        if not change.serving:
            # The server itself answers: lookups, loads and saves go on, from and to L1.
            self.log.warning(
                "LMCache L2 store is failing: chunks stored to it are lost and what it "
                "would serve is recomputed, until it serves again",
                tiers=tiers,
                failed=change.failures,
                process=self.process,
            )
            return
        self.log.warning(
            "LMCache L2 store serves again",
            tiers=tiers,
            down_s=round(change.down_s, 1),
            failed=change.failures,
            process=self.process,
        )
