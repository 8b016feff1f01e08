"""KV Composer ``lmcache`` plugin: LMCache as a pipeline node.

Importing this package is light (no torch, no LMCache): the runtime nodes live
in :mod:`kvc_lmcache.server_node` (server mode) and :mod:`kvc_lmcache.inprocess`,
chosen by :func:`kvc_lmcache.node.node_class_for`.
"""

from kvc_lmcache.config import LMCacheConfig, ServerConfig

__all__ = ["LMCacheConfig", "ServerConfig"]
__version__ = "0.1.0"
