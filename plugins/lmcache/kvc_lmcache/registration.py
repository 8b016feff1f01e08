"""Discovery: registers the ``lmcache`` plugin type. Light on purpose (no torch, no LMCache)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel

from composer import Capabilities, PluginType, hookimpl
from kvc_lmcache.config import LMCacheConfig


def capabilities(config: BaseModel) -> Capabilities:
    assert isinstance(config, LMCacheConfig)
    if config.mode == "server":
        # LMCacheMPConnector: SupportsHMA, async loads and saves.
        return Capabilities(hma=True, async_save=True, async_load=True)
    one_group = config.kv_cache_group is not None
    return Capabilities(
        # LMCache's in-process impl has no request_finished_all_groups; with one
        # selected group the node supplies it (the chain passes that group only).
        hma=one_group,
        kv_cache_groups="one" if one_group else "all",
        # CacheBlend reads the model: the core's graph check then demands a
        # dependency that provides it (a model-tracker node).
        needs_model=config.enable_blending,
    )


def check(
    node_id: str, config: BaseModel, data: dict[str, Any]
) -> Iterable[tuple[tuple[str | int, ...], str]]:
    """Cross-node checks: blending's tracker must register with LMCache under its engine id."""
    assert isinstance(config, LMCacheConfig)
    if not config.enable_blending:
        return
    nodes = data.get("nodes") or {}
    needs = nodes.get(node_id, {}).get("needs") or []
    for i, dep in enumerate(needs):
        node = nodes.get(dep) if isinstance(dep, str) else None
        if not isinstance(node, dict) or node.get("plugin") != "model-tracker":
            continue
        tracker = node.get("config") or {}
        if tracker.get("lmcache") == "never":
            yield (
                ("needs", i),
                (
                    f'enable_blending: tracker "{dep}" has lmcache: never, so CacheBlend would not '
                    "find the model; use lmcache: auto or always"
                ),
            )
        instance = tracker.get("lmcache_instance_id", "vllm-instance")
        if instance != "vllm-instance":
            yield (
                ("needs", i),
                (
                    f'enable_blending: tracker "{dep}" registers the model as "{instance}", but '
                    'LMCache\'s CacheBlend looks it up as "vllm-instance"'
                ),
            )


LMCACHE = PluginType(
    name="lmcache",
    # The class depends on the mode: kvc_lmcache.node.node_class_for(config).
    node="kvc_lmcache.node:node_class_for",
    config=LMCacheConfig,
    description=(
        "LMCache: a `lmcache server` (started or given) or LMCache in-process (GPU). A started "
        "server's L2 tiers (server.l2): resp (Valkey/Redis, shared by a fleet), valkey "
        "(valkey-glide: cluster, TLS), fs (a directory), or another LMCache adapter by name."
    ),
    default_role="both",
    roles=frozenset({"load", "save", "both"}),
    capabilities=capabilities,
    check=check,
    model_support="kvc_lmcache.model_support:model_support",
)


@hookimpl
def register_plugin_types(register: Callable[[PluginType], None]) -> None:
    register(LMCACHE)
