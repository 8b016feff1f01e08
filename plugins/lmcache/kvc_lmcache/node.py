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

import dataclasses
import time
from typing import Any

from composer.builtin import VllmConnectorConfig
from composer.hookspecs import hookimpl
from composer.plugin import NodeContext, Plugin
from composer.vllm.native import NativeConnectorNode
from kvc_lmcache.config import TCP_URL, LMCacheConfig
from kvc_lmcache.server import ServerError, ServerInfo, ServerSettings, SharedServer, check_server

CONNECTOR = "LMCacheMPConnector"


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
            self.shared = SharedServer(
                _engine_key(ctx),
                ServerSettings(
                    chunk_size=config.server_chunk_size(),
                    l1_size_gb=config.server.l1_size_gb,
                    eviction_policy=config.server.eviction_policy,
                    transfer_mode=server_transfer_mode(config.server.transfer_mode),
                    extra_args=tuple(config.server.extra_args),
                    startup_timeout=config.server.startup_timeout,
                ),
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
        try:
            self.connector.shutdown()
        finally:
            self.release_server()


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
    if config.mode == "server":
        return LMCacheServerNode
    from kvc_lmcache.inprocess import LMCacheInProcessNode

    return LMCacheInProcessNode


class LMCacheNode(Plugin):
    """The registered node class: builds the node for the configured mode.

    (A plugin type names one class; ``__new__`` returns the mode's class so the
    chain sees that class's hooks.)
    """

    def __new__(cls, ctx: NodeContext) -> Any:
        config = ctx.config
        assert isinstance(config, LMCacheConfig)
        return node_class_for(config)(ctx)
