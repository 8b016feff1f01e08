"""The ``lmcache`` node's class for its configured mode (the plugin type names
:func:`node_class_for`).

Server mode is :mod:`kvc_lmcache.server_node` (its hooks), with
:mod:`kvc_lmcache.server_setup` (its server, found before its connector) and
:mod:`kvc_lmcache.supervision` (its server watched, restarted and resumed);
in-process mode is :mod:`kvc_lmcache.inprocess`. What either reaches of
LMCache beyond its public API is in :mod:`kvc_lmcache.lmcache_internals`.
Each class is imported only for its mode.
"""

from __future__ import annotations

from composer import Plugin
from kvc_lmcache.config import LMCacheConfig


def node_class_for(config: LMCacheConfig) -> type[Plugin]:
    """The node class for the configured mode (the plugin type names this function)."""
    if config.mode == "server":
        from kvc_lmcache.server_node import LMCacheServerNode

        return LMCacheServerNode
    from kvc_lmcache.inprocess import LMCacheInProcessNode

    return LMCacheInProcessNode
