"""The base class of plugin instances (one per pipeline node and vLLM process), and
what a node raises when its store is away."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel

from composer.plugin_types import NodeRole, VllmProcess
from composer.stats import NodeStats


class Unavailable(Exception):
    """Raised by a node's hook when its store is away: the call did nothing.

    The node stays on; vLLM recomputes what the call would have served. The
    node's part of the contract: while the store is away it raises this from
    every lookup, load and save it is asked for (a call that returns normally
    ends the outage), and anything it had already started, it still reports
    finished (``get_finished``) or failed (``get_block_ids_with_load_errors``),
    so no request waits and no block stays held. A subclass (the ``lmcache``
    node's ``ServerDown``) says which store is away.
    """


@dataclass
class NodeContext:
    """What a node is told when it is created."""

    node_id: str
    config: BaseModel
    role: NodeRole
    process: VllmProcess
    #: The service of each node this node ``needs``, by node id.
    needs: Mapping[str, Any] = field(default_factory=dict)
    #: Its ``on_error`` policy: what the chain does when it raises (a node that finds at
    #: start that it cannot serve may refuse to start under ``fail``, and say so and
    #: serve nothing under the others).
    on_error: str = "fail"
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

        self.log = structlog.get_logger("kv_composer").bind(node=ctx.node_id, process=ctx.process)

    @classmethod
    def launch_problems(cls, config: Any) -> list[str]:
        """What keeps a node of this class with ``config`` from running on this machine,
        found without starting it (a library it reaches missing, or of a release whose
        internals differ). ``kvc validate --deep`` reports each, located at the node; a
        node that finds one at engine start refuses to start in the same words.
        Default: none."""
        return []

    def service(self) -> Any:
        """What nodes that ``need`` this one receive (default: the instance)."""
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} node={self.node_id!r} process={self.ctx.process}>"
