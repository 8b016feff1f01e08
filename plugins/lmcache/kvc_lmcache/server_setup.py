"""What the server node does before its connector exists: the server, and the config
that points LMCache's connector at it.

The node starts a server (shared by the engine's processes, see
:mod:`kvc_lmcache.server_sharing`) or checks the given one over its HTTP frontend, so
a mismatch is a clear error at start-up instead of a worker waiting out
``mq_timeout``; then vLLM's ``LMCacheMPConnector`` is made through the
built-in ``vllm`` node, with a computed ``kv_connector_extra_config``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from composer import NodeContext, VllmConnectorConfig
from kvc_lmcache.config import TCP_URL, LMCacheConfig
from kvc_lmcache.l2 import adapter_args
from kvc_lmcache.server_errors import ServerDoesNotFit
from kvc_lmcache.server_health import check_server
from kvc_lmcache.server_process import ServerInfo, ServerSettings
from kvc_lmcache.server_sharing import SharedServer

CONNECTOR = "LMCacheMPConnector"


def block_size_of(vllm_config: Any) -> int | None:
    size = getattr(getattr(vllm_config, "cache_config", None), "block_size", None)
    return int(size) if size else None


def check_chunk_size(chunk_size: int, block_size: int | None) -> None:
    if block_size and chunk_size % block_size:
        raise ServerDoesNotFit(
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


def native_config(config: LMCacheConfig, server: ServerInfo) -> VllmConnectorConfig:
    """The built-in ``vllm`` node's config: LMCacheMPConnector, pointed at ``server``."""
    return VllmConnectorConfig.model_validate(
        {
            "connector": CONNECTOR,
            "extra_config": mp_extra_config(config, server.host, server.port),
        }
    )


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


def engine_key(ctx: NodeContext) -> str:
    """Same in every process of one engine: vLLM's engine id (set once, in the API process)."""
    kv = getattr(ctx.vllm_config, "kv_transfer_config", None)
    engine_id = getattr(kv, "engine_id", None)
    if not engine_id:
        engine_id = f"pid-{os.getpid()}"
    return f"{engine_id}/{ctx.node_id}"


def server_settings(ctx: NodeContext, config: LMCacheConfig) -> ServerSettings:
    """What the node's started server is given on its command line."""
    l2_argv, l2_env = adapter_args(config.server.l2)
    return ServerSettings(
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
    )


@dataclass
class FoundServer:
    """The node's server, once it is known to be there and to fit the engine."""

    info: ServerInfo
    #: The started server, shared by the engine's processes; None for a given one.
    shared: SharedServer | None = None
    #: A given server's chunk size, read from its HTTP frontend (None without one).
    chunk_size: int | None = None


def find_server(ctx: NodeContext, config: LMCacheConfig) -> FoundServer:
    """The given server (checked over its HTTP frontend when it has one), or the
    engine's started one (started here, or attached to). Raises a
    :class:`~kvc_lmcache.server_errors.LMCacheServerError`."""
    block_size = block_size_of(ctx.vllm_config)
    if config.server.url is not None:
        match = TCP_URL.match(config.server.url)
        assert match is not None  # checked by the config model
        found = FoundServer(ServerInfo(match["host"], int(match["port"]), None))
        if config.server.http_url:
            mp = check_server(
                config.server.http_url.rstrip("/"),
                block_size=block_size,
                transfer_mode=config.server.transfer_mode,
            )
            found.chunk_size = int(mp.get("chunk_size", 0))
        return found
    check_chunk_size(config.server_chunk_size(), block_size)
    shared = SharedServer(engine_key(ctx), server_settings(ctx, config), node_id=ctx.node_id)
    return FoundServer(shared.acquire(), shared)
