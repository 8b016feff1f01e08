"""KV cache events on the scheduler: each names its node and is counted on the
node's stats. (The nodes' counters are reported by
:meth:`~composer.chain.core.ChainCore.get_kv_connector_stats`, in either process.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from composer.stats import NodeStats

#: vLLM's KV cache event classes, by name, and the node counter each adds to.
EVENT_COUNTERS = {
    "BlockStored": "events_stored",
    "BlockRemoved": "events_removed",
    "AllBlocksCleared": "events_cleared",
}


def owned_events(node_id: str, events: Iterable[Any], stats: NodeStats | None) -> Iterable[Any]:
    """The node's events, each naming its node, counted on the node's ``stats``
    (``events_stored``/``events_removed``: blocks announced; ``events_cleared``)."""
    counted: dict[str, int] = {}
    for event in events:
        # vLLM's stored/removed events name the offloading tier that made
        # them in ``ownership``: the node, unless set.
        if getattr(event, "ownership", "") is None:
            event.ownership = node_id
        kind = EVENT_COUNTERS.get(type(event).__name__)
        if kind is not None:
            blocks = len(getattr(event, "block_hashes", None) or ()) or 1
            counted[kind] = counted.get(kind, 0) + blocks
        yield event
    if stats is not None:
        for name, count in counted.items():
            stats.extra.add(name, count)
