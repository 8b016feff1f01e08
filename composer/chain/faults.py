"""What a node's fault does to vLLM's requests: the error policies and their bookkeeping.

A node's ``on_error`` policy says what the chain does when one of its hooks
raises:

* ``fail``: the engine stops with :class:`NodeFailed` (naming the node, hook and
  plugin); nothing is served.
* ``recompute``: the node stays on where the failed call's effect can be undone
  by vLLM recomputing: a failed lookup is a miss, a failed *synchronous* load
  turns the blocks the node was loading this step into load errors, and a failed
  stats or events call loses only that report. Anywhere else (the hook that
  registers a load, the metadata hand-off, saves, transfer reports, ...) the
  node's scheduler and worker halves may be out of step, or an async transfer
  may still be writing into vLLM's blocks, and vLLM's connector interface has no
  call that cancels either; so the chain falls back to the safe side and switches
  the node off, as ``disable`` does.
* ``disable``: the node is switched off in *both* vLLM processes: its
  ``shutdown`` hook runs (which stops its transfers), every load it had in
  flight is reported failed (vLLM recomputes those requests' external tokens),
  and every request whose blocks it held for a save is released.

Which hooks ``recompute`` repairs, and how, is each hook's ``recompute`` in
:data:`composer.hookspecs.HOOKS`.

A node whose *store* is away (a server restarting, a store failing over, a
disk read-only) raises :class:`Unavailable` instead: that is not a fault, and
no policy applies. The chain counts it, keeps the node on, and vLLM recomputes
what the call would have served: a lookup is a miss, a load's blocks are
recomputed, a save is skipped (each hook's ``away`` in
:data:`composer.hookspecs.HOOKS`; where a hook has no such meaning, ``away`` is
"a fault" and ``on_error`` applies after all). Nothing here imports torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from composer.plugin import Unavailable

__all__ = ["NodeFailed", "Outage", "Unavailable", "WorkerLedger"]


class NodeFailed(RuntimeError):
    """A node with ``on_error: fail`` raised: the engine stops, with this message."""

    def __init__(self, node_id: str, plugin: str, hook: str, exc: BaseException) -> None:
        super().__init__(
            f'KV Composer node "{node_id}" (plugin {plugin}) failed in {hook}: {exc!r}. '
            "Its on_error policy is fail, so the engine stops; set on_error: recompute "
            "or disable on the node to keep serving without it."
        )
        self.node_id = node_id
        self.hook = hook


@dataclass
class Outage:
    """A node's store away, as one vLLM process sees it."""

    #: time.monotonic() of the first call that found it away.
    since: float
    #: Calls that found it away, and the blocks those calls left to vLLM to recompute.
    calls: int = 0
    blocks: int = 0


class WorkerLedger:
    """Worker side: who holds which finished request's blocks, and which async loads
    are in flight, per node, so that switching a node off releases exactly its share.

    vLLM frees a finished request's blocks once the connector reports it in
    ``finished_sending``; with several saving nodes that is when the last holder
    has finished (MultiConnector's rule). A request finishes receiving when the
    node loading it says so.
    """

    def __init__(self) -> None:
        #: Request -> nodes still saving from its blocks.
        self._holders: dict[str, set[str]] = {}
        #: Node -> requests it is loading asynchronously.
        self._loading: dict[str, set[str]] = {}

    def hold(self, request_id: str, nodes: Iterable[str]) -> None:
        """Record a finished request's holders (the scheduler sends them before any
        node's worker half can report the request sent)."""
        self._holders[request_id] = set(nodes)

    def sent(self, node_id: str, request_ids: Iterable[str]) -> set[str]:
        """``node_id`` finished saving these requests: those now free of every holder."""
        done: set[str] = set()
        for req in request_ids:
            holders = self._holders.get(req)
            if holders is None:
                done.add(req)  # no hold recorded: passed on as MultiConnector does
                continue
            holders.discard(node_id)
            if not holders:
                del self._holders[req]
                done.add(req)
        return done

    def release(self, node_id: str) -> set[str]:
        """``node_id`` is switched off: the requests that only it still held."""
        done = set()
        for req, holders in list(self._holders.items()):
            if node_id in holders:
                holders.discard(node_id)
                if not holders:
                    del self._holders[req]
                    done.add(req)
        return done

    def loading(self, node_id: str, request_id: str) -> None:
        self._loading.setdefault(node_id, set()).add(request_id)

    def received(self, node_id: str, request_ids: Iterable[str]) -> None:
        mine = self._loading.get(node_id)
        if mine:
            mine.difference_update(request_ids)

    def has_async_loads(self, node_id: str) -> bool:
        return bool(self._loading.get(node_id))

    def drop_loads(self, node_id: str) -> set[str]:
        """``node_id`` is switched off: the requests it was still loading."""
        return self._loading.pop(node_id, set())

    def held(self) -> int:
        """Finished requests whose blocks some node still holds."""
        return len(self._holders)
