"""The base class of plugin instances: one per pipeline node and vLLM process."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel

from composer.plugin_types import NodeRole, VllmProcess
from composer.stats import NodeStats


@dataclass
class NodeContext:
    """What a node is told when it is created."""

    node_id: str
    config: BaseModel
    role: NodeRole
    process: VllmProcess
    #: The service of each node this node ``needs``, by node id.
    needs: Mapping[str, Any] = field(default_factory=dict)
    #: vLLM's config, when running inside vLLM (None in unit tests).
    vllm_config: Any = None
    #: vLLM's ``KVCacheConfig`` (both roles get it; None in unit tests).
    kv_cache_config: Any = None
    stats: NodeStats = field(default_factory=NodeStats)


ConfigT = TypeVar("ConfigT", bound=BaseModel)


class Plugin(Generic[ConfigT]):
    """Subclass this, decorate lifecycle methods with ``@hookimpl``.

    ``class MyNode(Plugin[MyConfig])`` types ``self.config`` as ``MyConfig`` (the
    node's validated config). Only implemented hooks are ever called.
    ``self.log`` is a structlog logger bound with the node id and its vLLM
    process; ``self.stats`` are the node's counters.
    """

    config: ConfigT

    def __init__(self, ctx: NodeContext) -> None:
        self.ctx = ctx
        self.node_id = ctx.node_id
        # The chain passes the config validated by the plugin type's own model.
        self.config = cast(ConfigT, ctx.config)
        self.stats = ctx.stats
        import structlog  # lazily: `import composer` stays light

        self.log = structlog.get_logger("kv_composer").bind(
            node=ctx.node_id, process=ctx.process
        )

    def service(self) -> Any:
        """What nodes that ``need`` this one receive (default: the instance)."""
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} node={self.node_id!r} process={self.ctx.process}>"
