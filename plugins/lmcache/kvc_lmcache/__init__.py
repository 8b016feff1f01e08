"""KV Composer ``lmcache`` plugin: LMCache as a pipeline node.

Importing this package is light (no torch, no LMCache): the runtime nodes live
in :mod:`kvc_lmcache.node` (server mode) and :mod:`kvc_lmcache.inprocess`.
"""

from kvc_lmcache.config import LMCacheConfig, ServerConfig

__all__ = ["LMCacheConfig", "ServerConfig"]
__version__ = "0.1.0"
