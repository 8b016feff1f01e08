"""A node's failure: what each ``on_error`` policy does, and what it leaves behind.

The chain applies the policy (:meth:`~composer.chain.core.ChainCore.fault`;
each side says what a fault costs its own state):

* ``fail``: the engine stops with :class:`NodeFailed` (naming the node,
  hook and plugin); nothing is served.
* ``recompute``: the node stays on where vLLM's recompute undoes the failed
  call's effect: a failed lookup is a miss, a failed synchronous load turns the
  blocks the node was loading this step into load errors, a failed stats or
  events call loses only that report (each hook's ``recompute`` in
  :data:`composer.hook_table.HOOKS`). Anywhere else the node's two halves may be
  out of step, or an async transfer still writing into vLLM's blocks, and vLLM's
  connector interface has no call that cancels either: the node is switched
  off, as ``disable`` does.
* ``disable``: the node is switched off in both vLLM processes: its
  ``shutdown`` runs (which stops its transfers), every load it had in flight is
  reported failed (vLLM recomputes those requests' external tokens), and every
  request whose blocks it held for a save is released. It leaves this
  process's call lists for good; the other process follows through the metadata.

:class:`Unavailable` (the node's store is away) is no fault: the node stays on,
and its outage (:class:`Outage`, as one process sees it) is logged when it
starts and when it ends. The worker's ledger of held and loading requests,
which a node switched off releases, is :class:`WorkerLedger`. Nothing here
imports torch or vLLM.
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


class _AsyncLoad:
    __slots__ = ("pending", "sync", "blocks", "failed")

    def __init__(
        self, pending: set[str], sync: set[str], blocks: frozenset[int], failed: bool
    ) -> None:
        #: Nodes still loading it.
        self.pending = pending
        #: Those of them loading synchronously (the chain reports them done).
        self.sync = sync
        #: Every block its ranges load.
        self.blocks = blocks
        #: A range failed: vLLM recomputes the request's external tokens.
        self.failed = failed


class WorkerLedger:
    """Worker side: who holds which finished request's blocks, and which async loads
    are in flight, per node, so that switching a node off releases exactly its share.

    vLLM frees a finished request's blocks once the connector reports it in
    ``finished_sending``; with several saving nodes that is when the last holder
    has finished (MultiConnector's rule). A request loading asynchronously
    (from one node, or a range from each of several) finishes receiving when
    every node loading it says so, and has failed if any range failed; it is
    reported only then, since until then a node may still write into its blocks.
    """

    def __init__(self) -> None:
        #: Request -> nodes still saving from its blocks.
        self._holders: dict[str, set[str]] = {}
        #: Request -> its async load in flight.
        self._loads: dict[str, _AsyncLoad] = {}

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

    def loading(
        self,
        request_id: str,
        nodes: Iterable[str],
        blocks: frozenset[int],
        *,
        sync: Iterable[str] = (),
        failed: bool = False,
    ) -> None:
        """A request starts loading from ``nodes``, of which ``sync`` load
        synchronously (``failed``: a range already did)."""
        self._loads[request_id] = _AsyncLoad(set(nodes), set(sync), blocks, failed)

    def received(self, node_id: str, request_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """``node_id`` finished loading these: (requests now done, those of them failed).

        A request the ledger does not know is passed on as done (MultiConnector's rule)."""
        unknown: set[str] = set()
        for req in request_ids:
            load = self._loads.get(req)
            if load is None:
                unknown.add(req)
            else:
                load.pending.discard(node_id)
        done, failed = self._take_done()
        return done | unknown, failed

    def fail_requests(self, request_ids: Iterable[str]) -> None:
        """A node reported these loads failed."""
        for req in request_ids:
            load = self._loads.get(req)
            if load is not None:
                load.failed = True

    def fail_blocks(self, blocks: set[int]) -> None:
        """These blocks failed to load: so did every request loading one."""
        for load in self._loads.values():
            if not load.failed and load.blocks & blocks:
                load.failed = True

    def loads_in_flight(self) -> bool:
        return bool(self._loads)

    def has_async_loads(self, node_id: str) -> bool:
        """Whether a transfer of ``node_id``'s may still write into vLLM's blocks."""
        return any(
            node_id in load.pending and node_id not in load.sync for load in self._loads.values()
        )

    def drop_loads(self, node_id: str) -> tuple[set[str], set[str]]:
        """``node_id`` is switched off: what it was loading failed. Returns (requests
        now done, those of them failed), as ``received``."""
        for load in self._loads.values():
            if node_id in load.pending:
                load.pending.discard(node_id)
                load.failed = True
        return self._take_done()

    def _take_done(self) -> tuple[set[str], set[str]]:
        """Loads no node is still working on, taken out: (all, the failed ones)."""
        done = {req for req, load in self._loads.items() if not load.pending}
        failed = {req for req in done if self._loads[req].failed}
        for req in done:
            del self._loads[req]
        return done, failed

    def held(self) -> int:
        """Finished requests whose blocks some node still holds."""
        return len(self._holders)
