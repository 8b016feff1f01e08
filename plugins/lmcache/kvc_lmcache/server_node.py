"""``LMCacheServerNode``: LMCache multiprocess mode as a pipeline node (the default mode).

The node wraps vLLM's ``LMCacheMPConnector`` (LMCache's own class of that name
when LMCache is installed) through vLLM's factory, by reusing the built-in
``vllm`` node with a computed ``kv_connector_extra_config``. Before the
connector exists the node finds its server (:mod:`kvc_lmcache.server_setup`);
afterwards a :class:`~kvc_lmcache.supervision.ServerSupervisor` watches it. The
hooks here read the supervisor's liveness flag: while the server is away they
let LMCache drop the work and raise :class:`~kvc_lmcache.server_errors.ServerDown`.
"""

from __future__ import annotations

import time
from typing import Any

from composer import NodeContext, hookimpl
from composer.vllm import NativeConnectorNode
from kvc_lmcache.config import LMCacheConfig
from kvc_lmcache.lmcache_internals import (
    launch_problems,
    quiet,
    refuse_unknown_lmcache,
    step_metadata,
)
from kvc_lmcache.loads import LoadCounter
from kvc_lmcache.server_errors import ServerDown
from kvc_lmcache.server_setup import FoundServer, find_server, native_config
from kvc_lmcache.supervision import ServerSupervisor
from kvc_lmcache.tenants import HashedSalt


class LMCacheServerNode(NativeConnectorNode):
    """LMCache multiprocess mode: a (started or given) ``lmcache server`` + LMCacheMPConnector."""

    @classmethod
    def launch_problems(cls, config: Any) -> list[str]:
        return launch_problems("server")

    def __init__(self, ctx: NodeContext) -> None:
        config = ctx.config
        assert isinstance(config, LMCacheConfig)
        refuse_unknown_lmcache(ctx.node_id, "server")
        t0 = time.perf_counter()
        found = find_server(ctx, config)
        seconds = time.perf_counter() - t0
        native = native_config(config, found.info)
        try:
            super().__init__(ctx, connector=native)
        except BaseException:
            if found.shared is not None:
                found.shared.release()
            raise
        self.native_config = native
        self.shared = found.shared
        self._report_server(found, seconds)
        self._shut_down = False
        #: The retrieves LMCache was asked for, counted into tokens_loaded once done.
        self.loads = LoadCounter()
        self.supervisor = ServerSupervisor(
            connector=self.connector,
            server=found.info,
            shared=found.shared,
            config=config.server,
            gauges=self.stats.gauges,
            log=self.log,
            process=ctx.process,
            node_id=ctx.node_id,
        ).start()

    def _report_server(self, found: FoundServer, seconds: float) -> None:
        if found.chunk_size is not None:
            self.stats.gauges["server_chunk_size"] = found.chunk_size
        if found.shared is None:
            return
        self.stats.gauges["server_started"] = int(found.shared.started)
        self.log.info(
            "LMCache server " + ("started" if found.shared.started else "attached"),
            url=found.info.url,
            http=found.info.http_url,
            pid=found.info.pid,
            seconds=round(seconds, 2),
        )

    def _gone(self, hook: str) -> ServerDown:
        server = self.supervisor.server
        where = server.url
        if server.pid is not None:
            where += f" (pid {server.pid}, started by this engine)"
        return ServerDown(f"lmcache: the LMCache server at {where} is down; {hook} skipped it")

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
        # (LMCache reads vLLM's Request through it: kvc_lmcache.tenants)
        shown: Any = HashedSalt(request.raw)
        if self.supervisor.alive:
            try:
                return self.connector.get_num_new_matched_tokens(shown, num_computed_tokens)
            except Exception as exc:
                if self.supervisor.alive:
                    raise
                raise self._gone("the lookup") from exc
        # LMCache is in its degraded mode (no server I/O): it still creates the
        # request's tracker, which update_state_after_alloc requires. Even a
        # hit it remembers from before the outage is not claimed: a miss.
        self.connector.get_num_new_matched_tokens(shown, num_computed_tokens)
        raise self._gone("the lookup")

    def _start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """The node's ``start_load_kv`` (NativeConnectorNode's hookimpl, made direct by
        :meth:`direct_hooks`): the chain passes vLLM's keyword arguments, as to the
        native node."""
        if self.supervisor.alive:
            self.loads.started(step_metadata(self.connector))
            try:
                self.connector.start_load_kv(forward_context, **kwargs)
            except Exception as exc:
                if self.supervisor.alive:
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
        if self.supervisor.alive:
            try:
                self.connector.wait_for_save()
            except Exception as exc:
                if self.supervisor.alive:
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
        alive = self.supervisor.stop()
        try:
            if not alive:
                # LMCache's shutdown waits mq_timeout for the dead server to
                # acknowledge the unregistration, then closes sockets that may
                # hold unsent messages: neither must hold the process.
                quiet(self.connector)
            self.connector.shutdown()
        finally:
            self.release_server()
            self.log.info(
                "lmcache node shut down",
                server_alive=alive,
                seconds=round(time.perf_counter() - t0, 3),
                process=self.ctx.process,
            )


def _device(raw: dict[str, Any]) -> str:
    return str(next(iter(raw.values())).device) if raw else "?"
