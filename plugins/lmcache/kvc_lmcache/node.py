"""``LMCacheServerNode``: LMCache multiprocess mode as a pipeline node (the default mode).

The node wraps vLLM's ``LMCacheMPConnector`` (LMCache's own class of that name
when LMCache is installed) through vLLM's factory, by reusing the built-in
``vllm`` node with a computed ``kv_connector_extra_config``. Before the
connector exists, the node makes sure a server is there and fits the engine:
it starts one (shared by the engine's processes, see :mod:`kvc_lmcache.server`)
or checks the given one over its HTTP frontend, so a mismatch is a clear error
at start-up instead of a worker waiting out ``mq_timeout``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from composer import NodeContext, Plugin, VllmConnectorConfig, hookimpl
from composer.vllm import NativeConnectorNode
from kvc_lmcache import l2_stats
from kvc_lmcache.config import TCP_URL, LMCacheConfig
from kvc_lmcache.l2 import adapter_args
from kvc_lmcache.loads import LoadCounter
from kvc_lmcache.server import (
    PROBE_TIMEOUT,
    ServerError,
    ServerGone,
    ServerInfo,
    ServerLeft,
    ServerSettings,
    ServerWatcher,
    SharedServer,
    check_server,
    get_json,
    http_probe,
    running,
    tcp_probe,
)

CONNECTOR = "LMCacheMPConnector"
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


def block_size_of(vllm_config: Any) -> int | None:
    size = getattr(getattr(vllm_config, "cache_config", None), "block_size", None)
    return int(size) if size else None


def check_chunk_size(chunk_size: int, block_size: int | None) -> None:
    if block_size and chunk_size % block_size:
        raise ServerError(
            f"lmcache: chunk size {chunk_size} is not a multiple of vLLM's block size "
            f"{block_size}; use a multiple of {block_size} (server.chunk_size or chunk_size)"
        )


def mp_extra_config(config: LMCacheConfig, host: str, port: int) -> dict[str, Any]:
    """The ``lmcache.mp.*`` keys LMCacheMPConnector reads from its extra config."""
    extra: dict[str, Any] = {
        "lmcache.mp.host": f"tcp://{host}",
        "lmcache.mp.port": port,
        "lmcache.mp.mp_transfer_mode": config.server.transfer_mode,
        "lmcache.mp.mq_timeout": config.server.mq_timeout,
    }
    if config.server.heartbeat_interval is not None:
        extra["lmcache.mp.heartbeat_interval"] = config.server.heartbeat_interval
    return extra


def event_log_args(vllm_config: Any, config: LMCacheConfig) -> tuple[str, ...]:
    """The started server's flags for vLLM's KV events.

    LMCache's connector publishes what its server's cache-event log reports when
    the server offers one (``kv_event_stream``), and else the chunks its worker
    stored. The log names a chunk's tokens only for stores in the lmcache_driven
    transfer mode (LMCache 0.5.6: ``MP_TOKENS`` is published by
    ``lmcache_driven_transfer`` alone), and a record without tokens is never
    published: with engine_driven stores, the log publishes nothing. So when vLLM
    publishes events and the stores are not lmcache_driven, the server keeps no
    log (``--kv-event-log-size 0``) and the worker publishes its own stores (not
    the server's evictions)."""
    kv_events = getattr(vllm_config, "kv_events_config", None)
    if not getattr(kv_events, "enable_kv_cache_events", False):
        return ()
    if config.server.transfer_mode == "lmcache_driven":
        return ()
    return ("--kv-event-log-size", "0")


def server_transfer_mode(connector_mode: str) -> str:
    """What a started server must support for the connector's mode."""
    return "auto" if connector_mode == "auto" else connector_mode


class LMCacheServerNode(NativeConnectorNode):
    """LMCache multiprocess mode: a (started or given) ``lmcache server`` + LMCacheMPConnector."""

    def __init__(self, ctx: NodeContext) -> None:
        config = ctx.config
        assert isinstance(config, LMCacheConfig)
        Plugin.__init__(self, ctx)
        self.shared: SharedServer | None = None
        block_size = block_size_of(ctx.vllm_config)
        t0 = time.perf_counter()
        if config.server.url is not None:
            match = TCP_URL.match(config.server.url)
            assert match is not None  # checked by the config model
            self.server = ServerInfo(match["host"], int(match["port"]), None)
            if config.server.http_url:
                mp = check_server(
                    config.server.http_url.rstrip("/"),
                    block_size=block_size,
                    transfer_mode=config.server.transfer_mode,
                )
                self.stats.gauges["server_chunk_size"] = int(mp.get("chunk_size", 0))
        else:
            check_chunk_size(config.server_chunk_size(), block_size)
            l2_argv, l2_env = adapter_args(config.server.l2)
            self.shared = SharedServer(
                _engine_key(ctx),
                ServerSettings(
                    chunk_size=config.server_chunk_size(),
                    l1_size_gb=config.server.l1_size_gb,
                    eviction_policy=config.server.eviction_policy,
                    transfer_mode=server_transfer_mode(config.server.transfer_mode),
                    extra_args=(
                        *l2_argv,
                        *event_log_args(ctx.vllm_config, config),
                        *config.server.extra_args,
                    ),
                    command_prefix=tuple(config.server.command_prefix),
                    startup_timeout=config.server.startup_timeout,
                    env=tuple(sorted(l2_env.items())),
                ),
                node_id=ctx.node_id,
            )
            self.server = self.shared.acquire()
            self.stats.gauges["server_started"] = int(self.shared.started)
            self.log.info(
                "LMCache server " + ("started" if self.shared.started else "attached"),
                url=self.server.url,
                http=self.server.http_url,
                pid=self.server.pid,
                seconds=round(time.perf_counter() - t0, 2),
            )
        native = VllmConnectorConfig.model_validate(
            {
                "connector": CONNECTOR,
                "extra_config": mp_extra_config(config, self.server.host, self.server.port),
            }
        )
        try:
            super().__init__(dataclasses.replace(ctx, config=native))
        except BaseException:
            self.release_server()
            raise
        # NativeConnectorNode's Plugin.__init__ set the native config; keep ours.
        self.config = config
        self.native_config = native
        #: Read at the top of every hook that would reach the server.
        self.server_alive = True
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
        self.stats.gauges["server_alive"] = 1
        self.stats.gauges["server_outages"] = 0
        self.stats.gauges["server_restarts"] = 0
        self.stats.gauges["server_restart_failures"] = 0
        self._down_since = 0.0
        #: time.monotonic() when the server last answered again after an outage,
        #: and when the node resumed (LMCache re-registered with it) after that.
        self.back_at: float | None = None
        self.resumed_at: float | None = None
        self._lock = threading.Lock()
        self._shut_down = False
        #: The retrieves LMCache was asked for, counted into tokens_loaded once done.
        self.loads = LoadCounter()
        #: The started server's L2 tiers: their work and failures, from its /metrics,
        #: and their outages, told from those.
        self.l2_tiers = len(config.server.l2) if self.shared is not None else 0
        self.l2_health = l2_stats.L2Health()
        self._ticks = 0
        if self.l2_tiers:
            self.stats.gauges["l2_adapters"] = self.l2_tiers
            for gauge in l2_stats.GAUGES:
                self.stats.gauges[gauge] = 0
            self.stats.gauges["l2_serving"] = 1
            self.stats.gauges["l2_outages"] = 0
        self.watcher = self._make_watcher().start()

    # -- liveness ---------------------------------------------------------------- #

    def _make_watcher(self) -> ServerWatcher:
        shared = self.shared
        if shared is not None:
            # Started by this engine: its pid is exact (read each time: a restart
            # by the engine's other process changes it).
            return ServerWatcher(
                lambda: running(shared.pid()),
                on_change=self._server_changed,
                on_tick=self._server_tick,
                name=f"kvc-lmcache-watch-{self.node_id}",
            )
        http_url = self.config.server.http_url
        probe = (
            http_probe(http_url.rstrip("/"))
            if http_url
            else tcp_probe(self.server.host, self.server.port)
        )
        # Two failed probes in a row: one slow answer on a busy host is no outage.
        return ServerWatcher(
            probe,
            failures=2,
            on_change=self._server_changed,
            on_tick=self._server_tick,
            name=f"kvc-lmcache-watch-{self.node_id}",
        )

    def _server_changed(self, alive: bool) -> None:
        if alive:
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
            if not _lmcache_healthy(self.connector):
                _fail_pending(self.connector, self.server.url)
            # Back: LMCache's own heartbeat re-registers the KV caches and ends
            # its degraded mode, woken now instead of at its next interval;
            # _server_tick resumes once it has.
            self.back_at = time.monotonic()
            _wake_heartbeats(self.connector)
            self.log.info("LMCache server answers again", url=self.server.url)
            # Resume as soon as the woken heartbeat has re-registered, not a tick later.
            deadline = self.back_at + RESUME_WAIT_S
            while not self._resume_if_healthy() and time.monotonic() < deadline:
                time.sleep(0.01)
            return
        with self._lock:
            # LMCache's own degraded mode first, then the flag: a hook that sees
            # the flag down finds LMCache no longer talking to the server.
            _degrade(self.connector)
            _fail_pending(self.connector, self.server.url)
            self.server_alive = False
            self.down_events += 1
            self._down_since = time.monotonic()
            self._restart_tries = 0
            self._restart_at = self._down_since
        # A server started again counts its L2 work from 0.
        self.l2_health.new_server()
        self.stats.gauges["server_alive"] = 0
        self.stats.gauges["server_outages"] = self.down_events
        owned = self.shared is not None
        self.log.warning(
            "LMCache server is down: lookups miss, loads are recomputed, saves are skipped "
            + ("until it is restarted" if owned else "until it answers again"),
            url=self.server.url,
            http=self.server.http_url or self.config.server.http_url,
            pid=self.server.pid,
            process=self.ctx.process,
            owned=owned,
        )

    def _restart_due(self) -> None:
        """Start a restart of the started server if a try is due, or settle the one
        under way (on the watcher thread; the restart itself runs on ``_RESTARTS``,
        and the server is started from a thread that lives as long as the process)."""
        shared, limit = self.shared, self.config.server.restarts
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
        future, limit = self._restarting, self.config.server.restarts
        if future is None or not future.done():
            return
        self._restarting = None
        seconds = round(time.perf_counter() - self._restart_t0, 2)
        try:
            info, restarted = future.result()
        except ServerLeft as exc:
            self._restart_tries = limit  # for good: the engine is stopping
            self.log.info("LMCache server not restarted", reason=str(exc))
            return
        except ServerError as exc:
            last = self._restart_tries >= limit
            backoff = RESTART_BACKOFF_S * 2 ** (self._restart_tries - 1)
            self._restart_at = time.monotonic() + backoff
            self.stats.gauges["server_restart_failures"] += 1
            self.log.error(
                "LMCache server restart failed"
                + ("; no tries left: its store stays away until vLLM restarts" if last else ""),
                tries=self._restart_tries,
                limit=limit,
                error=str(exc).splitlines()[0],
            )
            return
        self.server = info
        if restarted:  # (else the engine's other process restarted it first)
            self.stats.gauges["server_restarts"] += 1
        self.log.warning(
            "LMCache server restarted" if restarted else "LMCache server restarted elsewhere",
            url=info.url,
            pid=info.pid,
            tries=self._restart_tries,
            seconds=seconds,
            process=self.ctx.process,
        )

    def _scrape_l2(self) -> None:
        http_url = self.server.http_url
        if not self.l2_tiers or http_url is None:
            return
        counts = l2_stats.scrape(http_url)
        if counts is None:
            return
        # Existing keys only: the chain reads this dict on another thread.
        for gauge, value in counts.items():
            self.stats.gauges[gauge] = value
        change = self.l2_health.observe(counts, time.monotonic())
        if change is None:
            return
        self.stats.gauges["l2_serving"] = int(change.serving)
        self.stats.gauges["l2_outages"] = self.l2_health.outages
        tiers = ", ".join(tier.describe() for tier in self.config.server.l2)
        if not change.serving:
            # The server itself answers: lookups, loads and saves go on, from and to L1.
            self.log.warning(
                "LMCache L2 store is failing: chunks stored to it are lost and what it "
                "would serve is recomputed, until it serves again",
                tiers=tiers,
                failed=change.failures,
                process=self.ctx.process,
            )
            return
        self.log.warning(
            "LMCache L2 store serves again",
            tiers=tiers,
            down_s=round(change.down_s, 1),
            failed=change.failures,
            process=self.ctx.process,
        )

    def _server_tick(self, alive: bool) -> None:
        self._ticks += 1
        if alive and self._ticks % L2_SCRAPE_TICKS == 0:
            self._scrape_l2()
        if not alive:
            # Requests LMCache sent since the last tick (a store it began before
            # it was degraded sends its second half after) would each wait out
            # mq_timeout: end those waits now, every tick of the outage, also
            # while a restart is under way. Only while LMCache is degraded: a
            # healthy adapter reads a failed future's result and raises.
            if not _lmcache_healthy(self.connector):
                _fail_pending(self.connector, self.server.url)
            self._restart_due()
            return
        self._restart_settled()
        shared = self.shared
        if shared is not None and self.server_alive:
            pid = shared.pid()
            if pid is not None and pid != self.server.pid:
                # Restarted by the engine's other process between two probes:
                # LMCache must register with the new server, which only its
                # heartbeat's way back from degraded mode does.
                self.log.warning("LMCache server was restarted", pid=pid, was=self.server.pid)
                self.server = dataclasses.replace(self.server, pid=pid)
                self._server_changed(False)
                self._server_changed(True)
                return
        self._resume_if_healthy()

    def _resume_if_healthy(self) -> bool:
        """Resume once LMCache is out of its degraded mode; True if the node is on."""
        if self.server_alive:
            return True
        if not _lmcache_healthy(self.connector):
            return False
        if self.ctx.process == "scheduler" and not self._worker_registered():
            # A restarted server answers lookups only once the engine's worker
            # half has registered its KV caches again; asked earlier, a lookup
            # waits out mq_timeout. (The worker half is healthy only once it has.)
            return False
        with self._lock:
            self.server_alive = True
            self.resumed_at = time.monotonic()
        self.stats.gauges["server_alive"] = 1
        self.log.warning(
            "LMCache server is back: resuming",
            url=self.server.url,
            down_s=round(self.resumed_at - self._down_since, 2),
            resume_s=round(self.resumed_at - (self.back_at or self._down_since), 2),
            process=self.ctx.process,
        )
        return True

    def _worker_registered(self) -> bool:
        """Whether the server lists a registered worker (its ``/status``); True when
        the server has no HTTP frontend to ask."""
        http_url = self.server.http_url or self.config.server.http_url
        if not http_url:
            return True
        try:
            status = get_json(f"{http_url.rstrip('/')}/status", timeout=PROBE_TIMEOUT)
        except (OSError, ValueError):
            return False
        return bool(
            status.get("registered_gpu_ids") or status.get("registered_non_cuda_instance_ids")
        )

    def _gone(self, hook: str) -> ServerGone:
        where = self.server.url
        if self.server.pid is not None:
            where += f" (pid {self.server.pid}, started by this engine)"
        return ServerGone(f"lmcache: the LMCache server at {where} is down; {hook} skipped it")

    def direct_hooks(self) -> dict[str, Any]:
        hooks = super().direct_hooks()
        # The two per-step worker hooks that reach the server check liveness
        # first. The per-layer hooks stay bound straight to the connector:
        # LMCache's MP connector does nothing in them (no server, no cost).
        hooks["start_load_kv"] = self._start_load_kv
        hooks["wait_for_save"] = self.wait_for_save
        return hooks

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        if self.server_alive:
            try:
                return self.connector.get_num_new_matched_tokens(request.raw, num_computed_tokens)
            except Exception as exc:
                if self.server_alive:
                    raise
                raise self._gone("the lookup") from exc
        # LMCache is in its degraded mode (no server I/O): it still creates the
        # request's tracker, which update_state_after_alloc requires. Even a
        # hit it remembers from before the outage is not claimed: a miss.
        self.connector.get_num_new_matched_tokens(request.raw, num_computed_tokens)
        raise self._gone("the lookup")

    def _start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """The node's ``start_load_kv`` (NativeConnectorNode's hookimpl, made direct by
        :meth:`direct_hooks`): the chain passes vLLM's keyword arguments, as to the
        native node."""
        if self.server_alive:
            with contextlib.suppress(AssertionError):  # no metadata bound: nothing to load
                self.loads.started(self.connector._get_connector_metadata())
            try:
                self.connector.start_load_kv(forward_context, **kwargs)
            except Exception as exc:
                if self.server_alive:
                    raise
                raise self._gone("start_load_kv") from exc
            return
        # Degraded LMCache drops the retrieves and reports them finished and
        # failed (its blocks are recomputed). Raised with or without a retrieve:
        # every store call in an outage says so, the first that returns ends it.
        self.connector.start_load_kv(forward_context, **kwargs)
        raise self._gone("start_load_kv")

    @hookimpl
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = self.connector.get_transfer_results(finished_req_ids)
        failed = getattr(results, "failed_recving", None) or ()
        self.loads.transfers_done(results.finished_recving, failed)
        self.loads.forget(finished_req_ids)
        return results

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        # vLLM asks right after get_transfer_results, in the same step.
        errors: set[int] = self.connector.get_block_ids_with_load_errors()
        self.stats.tokens_loaded += self.loads.settle(errors)
        return errors

    @hookimpl
    def wait_for_save(self) -> None:
        if self.server_alive:
            try:
                self.connector.wait_for_save()
            except Exception as exc:
                if self.server_alive:
                    raise
                raise self._gone("wait_for_save") from exc
            return
        self.connector.wait_for_save()
        raise self._gone("wait_for_save")

    def release_server(self) -> None:
        if self.shared is not None:
            self.shared.release()

    @hookimpl
    def initialize_worker_connector(
        self, model: Any, vllm_config: Any, kv_cache_config: Any
    ) -> None:
        # The tracker (created and initialised before this node) registered the
        # model with LMCache; record what this node can see of it.
        for node_id, service in self.ctx.needs.items():
            instance_id = getattr(service, "lmcache_instance_id", None)
            if instance_id is not None:
                self.stats.gauges["model_registered"] = 1
                self.log.info(
                    "model available to LMCache", tracker=node_id, instance_id=instance_id
                )

    @hookimpl
    def register_kv_caches(self, raw: dict[str, Any]) -> None:
        before = {name: t.data_ptr() for name, t in raw.items()}
        self.connector.register_kv_caches(raw)
        moved = sorted(name for name, t in raw.items() if t.data_ptr() != before[name])
        if moved:
            # LMCache's lmcache_driven mode on CPU re-homes vLLM's KV tensors into
            # POSIX shared memory (tensor.set_). Views taken before -- KV Composer's
            # canonical view and every other node's -- would then read and write
            # memory the model no longer uses: wrong KV served, silently.
            raise RuntimeError(
                f"lmcache: LMCache moved vLLM's KV cache tensors ({len(moved)} layers, e.g. "
                f"{moved[0]}) into shared memory (transfer mode "
                f"{self.config.server.transfer_mode} on {_device(raw)}); other nodes' views "
                "of the KV cache would be stale. Set server.transfer_mode: engine_driven "
                "(or auto) and start the server with --supported-transfer-mode engine_driven "
                "(or auto)"
            )

    @hookimpl
    def shutdown(self) -> None:
        # Also called when the chain switches the node off: once is enough.
        if self._shut_down:
            return
        self._shut_down = True
        t0 = time.perf_counter()
        self.watcher.stop()
        try:
            answers = bool(self.watcher.probe())
        except Exception:
            answers = False
        # No second chance for a network probe here: one unanswered probe is
        # reason enough not to wait on the server.
        alive = self.server_alive and answers
        if self.server_alive and not answers:
            self._server_changed(False)
        if alive:
            self._scrape_l2()
        try:
            if not alive:
                # LMCache's shutdown waits mq_timeout for the dead server to
                # acknowledge the unregistration, then closes sockets that may
                # hold unsent messages: neither must hold the process.
                _quiet(self.connector)
            self.connector.shutdown()
        finally:
            self.release_server()
            self.log.info(
                "lmcache node shut down",
                server_alive=alive,
                seconds=round(time.perf_counter() - t0, 3),
                process=self.ctx.process,
            )


# -- LMCache's adapters (lmcache 0.5.6) --------------------------------------------- #
# LMCache's MP adapters already have a degraded mode (health events cleared: no
# lookups, retrieves dropped and reported failed, stores dropped, no session
# ends), entered by their own heartbeat after up to twice its interval (10 s by
# default) and left by it after re-registering the KV caches. The watcher only
# enters it sooner; every access is guarded, so another LMCache layout degrades
# to LMCache's own behaviour instead of failing.


def _adapters(connector: Any) -> list[Any]:
    return [
        a
        for a in (
            getattr(connector, "worker_adapter", None),
            getattr(connector, "scheduler_adapter", None),
        )
        if a is not None
    ]


def _health_events(adapter: Any) -> list[threading.Event]:
    events = list((getattr(adapter, "_health_events", None) or {}).values())
    single = getattr(adapter, "_health_event", None)
    if single is not None:
        events.append(single)
    return [e for e in events if isinstance(e, threading.Event)]


def _clients(adapter: Any) -> list[Any]:
    clients = list((getattr(adapter, "req_clients", None) or {}).values())
    single = getattr(adapter, "req_client", None)
    if single is not None:
        clients.append(single)
    return [getattr(c, "_message_queue_client", c) for c in clients]


def _degrade(connector: Any) -> None:
    for adapter in _adapters(connector):
        for event in _health_events(adapter):
            event.clear()
        # Its heartbeat (started lazily) is what brings it back.
        start = getattr(adapter, "_ensure_heartbeat_started", None)
        if callable(start):
            with contextlib.suppress(Exception):
                start()


def _wake_heartbeats(connector: Any) -> None:
    """Run LMCache's heartbeats now (``PeriodicThread.wake``, safe from any thread):
    the server answers again, so the next request need not wait out their interval."""
    for adapter in _adapters(connector):
        threads = list((getattr(adapter, "_heartbeats", None) or {}).values())
        threads.append(getattr(adapter, "_heartbeat", None))
        for thread in threads:
            wake = getattr(thread, "wake", None)
            if callable(wake):
                with contextlib.suppress(Exception):
                    wake()


def _lmcache_healthy(connector: Any) -> bool:
    return all(bool(getattr(a, "is_healthy", True)) for a in _adapters(connector))


def _fail_pending(connector: Any, url: str) -> None:
    """End every wait on an unanswered request now, as its mq_timeout would."""
    try:
        from lmcache.v1.mp_observability.errors import LMCacheTimeoutError

        error: type[TimeoutError] = LMCacheTimeoutError
    except ImportError:  # pragma: no cover - another LMCache layout
        error = TimeoutError
    for adapter in _adapters(connector):
        for client in _clients(adapter):
            pending = getattr(client, "pending_futures", None)
            if not pending:
                continue
            for _ in range(3):
                try:
                    entries = list(pending.values())
                    break
                except RuntimeError:  # changed size under the polling thread
                    continue
            else:
                continue
            for entry in entries:
                future = entry[0] if isinstance(entry, tuple) else entry
                if hasattr(future, "query") and not future.query():
                    with contextlib.suppress(Exception):
                        future.set_exception(error(f"the LMCache server at {url} is down"))


def _quiet(connector: Any) -> None:
    """Make LMCache's shutdown skip a dead server: no waits, no lingering sockets."""
    import zmq

    for adapter in _adapters(connector):
        if hasattr(adapter, "_mq_timeout"):
            adapter._mq_timeout = 0.0
        for event in _health_events(adapter):
            event.clear()
        for client in _clients(adapter):
            sock = getattr(client, "socket", None)
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.setsockopt(zmq.LINGER, 0)
    _fail_pending(connector, "(shutting down)")


def _device(raw: dict[str, Any]) -> str:
    return str(next(iter(raw.values())).device) if raw else "?"


def _engine_key(ctx: NodeContext) -> str:
    """Same in every process of one engine: vLLM's engine id (set once, in the API process)."""
    kv = getattr(ctx.vllm_config, "kv_transfer_config", None)
    engine_id = getattr(kv, "engine_id", None)
    if not engine_id:
        import os

        engine_id = f"pid-{os.getpid()}"
    return f"{engine_id}/{ctx.node_id}"


def node_class_for(config: LMCacheConfig) -> type[Plugin]:
    """The node class for the configured mode (the plugin type names this function)."""
    if config.mode == "server":
        return LMCacheServerNode
    from kvc_lmcache.inprocess import LMCacheInProcessNode

    return LMCacheInProcessNode
