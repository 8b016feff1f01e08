"""Fault policy: what a node's exception does, by its ``on_error``.

* ``fail``: the engine stops with :class:`~.faults.NodeFailed` (naming the node,
  hook and plugin); nothing is served.
* ``recompute``: the node stays on where vLLM's recompute undoes the failed
  call's effect: a failed lookup is a miss, a failed synchronous load turns the
  blocks the node was loading this step into load errors, a failed stats or
  events call loses only that report (each hook's ``recompute`` in
  :data:`composer.hookspecs.HOOKS`). Anywhere else the node's two halves may be
  out of step, or an async transfer still writing into vLLM's blocks, and vLLM's
  connector interface has no call that cancels either: the node is switched
  off, as ``disable`` does.
* ``disable``: the node is switched off in both vLLM processes: its
  ``shutdown`` runs (which stops its transfers), every load it had in flight is
  reported failed (vLLM recomputes those requests' external tokens), and every
  request whose blocks it held for a save is released. It leaves this
  process's call lists for good; the other process follows through the metadata.

:class:`~composer.chain.faults.Unavailable` (the node's store is away) is no
fault: the node stays on, and its outage is logged when it starts and when it ends.
"""

from __future__ import annotations

import time
from typing import Any

from composer.chain.base import ChainBase
from composer.chain.faults import NodeFailed, Outage, Unavailable
from composer.hookspecs import HOOKS, Away, Recompute


class FaultPolicy(ChainBase):
    def fault(self, node_id: str, hook: str, exc: BaseException) -> bool:
        """Apply the node's error policy; returns only if the engine goes on, with
        nothing the node failed to load served. True: it was no fault but the
        node's store away (the caller drops the node's result, holds nothing for it)."""
        if isinstance(exc, Unavailable) and HOOKS[hook].away is not Away.FAULT:
            self.store_away(node_id, hook, exc)
            return True
        policy = self.policy.get(node_id, "fail")
        recompute = HOOKS[hook].recompute
        stats = self.stats[node_id]
        stats.errors += 1
        stats.extra.add(f"errors_{hook}")
        where = {"node": node_id, "hook": hook, "error": repr(exc)}
        if policy == "fail":
            if recompute is Recompute.BLOCKS_RECOMPUTED:
                self.load_error_blocks |= self.step_loads.get(node_id, set())
            self.log.error("node failed; on_error: fail stops the engine", **where)
            raise NodeFailed(node_id, self.plugin_names.get(node_id, "?"), hook, exc) from exc
        if policy == "recompute" and self._recovered(recompute, where):
            return False
        if node_id in self.disabled:
            return False
        if policy == "disable":
            reason = "on_error: disable"
        else:
            reason = (
                f"on_error: recompute cannot repair a fault in {hook} (the node's scheduler "
                "and worker halves may be out of step, or a transfer still in flight), so "
                "the node is switched off instead"
            )
        self.switch_off(node_id, reason, **where)
        return False

    def store_away(self, node_id: str, hook: str, exc: BaseException) -> None:
        """The node's store is away: count the call, recompute what it was loading."""
        stats = self.stats[node_id]
        stats.unavailable[hook] = stats.unavailable.get(hook, 0) + 1
        stats.changes.seen = True
        blocks = 0
        if HOOKS[hook].away is Away.BLOCKS_RECOMPUTED:
            step = self.step_loads.get(node_id, set())
            blocks = len(step - self.load_error_blocks)
            self.load_error_blocks |= step
            if blocks:
                stats.extra.add("blocks_recomputed", blocks)
        outage = self.outages.get(node_id)
        if outage is None:
            outage = self.outages[node_id] = Outage(time.monotonic())
            stats.extra.add("outages")
            stats.gauges["store_away"] = 1
            self.log.warning(
                "node's store is away: the node stays on, vLLM recomputes what it would "
                "have served or saved until it is back",
                node=node_id,
                hook=hook,
                error=repr(exc),
            )
        outage.calls += 1
        outage.blocks += blocks

    def store_back(self, node_id: str) -> None:
        """A lookup, load or save of the node returned normally: its outage is over."""
        outage = self.outages.pop(node_id)
        self.stats[node_id].gauges["store_away"] = 0
        self.log.warning(
            "node's store is back",
            node=node_id,
            away_s=round(time.monotonic() - outage.since, 3),
            calls_unavailable=outage.calls,
            blocks_recomputed=outage.blocks,
        )

    def _recovered(self, recompute: Recompute, where: dict[str, Any]) -> bool:
        """Whether vLLM's recompute undoes this fault (then the node stays on)."""
        node_id = where["node"]
        if recompute is Recompute.SWITCH_OFF:
            return False
        if recompute is Recompute.RESULT_LOST:
            self.log.warning("node failed; only this call's result is lost", **where)
            return True
        if self.ledger.has_async_loads(node_id):
            return False  # a transfer may still write into vLLM's blocks
        blocks = self.step_loads.get(node_id, set())
        self.load_error_blocks |= blocks
        self.stats[node_id].extra.add("blocks_recomputed", len(blocks))
        self.log.warning(
            "node failed while loading; vLLM recomputes the blocks it was loading",
            blocks=len(blocks),
            **where,
        )
        return True

    def switch_off(self, node_id: str, reason: str, **where: Any) -> None:
        """Take the node out of this process's chain for good, releasing what it held."""
        if node_id in self.disabled:
            return
        self.disabled.add(node_id)
        stats = self.stats[node_id]
        stats.disabled = True
        released = failed = blocks = 0
        if self.process == "worker":
            self.unreported_disabled.add(node_id)
            step = self.step_loads.get(node_id, set())
            blocks = len(step - self.load_error_blocks)
            self.load_error_blocks |= step
            done = self.ledger.release(node_id)
            _, loading = self.ledger.drop_loads(node_id)
            self.released |= done
            # (A request that other nodes still load is reported when they are done.)
            self.failed_recving |= loading
            released, failed = len(done), len(loading)
        if blocks:
            stats.extra.add("blocks_recomputed", blocks)
        self._stop(node_id)
        self._take_parting_events(node_id)
        self.log.warning(
            "node switched off",
            reason=reason,
            blocks_recomputed=blocks,
            requests_recomputed=failed,
            holds_released=released,
            **{"node": node_id, **where},
        )
        self.rebind()

    def _take_parting_events(self, node_id: str) -> None:
        """What the stopped node still has to say (a tier's ``BlockRemoved`` for
        everything it held): published with the next step's events, since its
        ``take_events`` leaves the call list now."""
        for name, fn in self.calls.get("take_events", ()):
            if name == node_id:
                try:
                    self.parting_events.extend(self.owned_events(node_id, fn()))
                except Exception as exc:
                    self.log.error(
                        "switched-off node's last events are lost", node=node_id, error=repr(exc)
                    )

    def _stop(self, node_id: str) -> None:
        # Its shutdown stops its transfers: nothing of it writes into vLLM's blocks
        # once the requests it was loading or holding are handed back.
        for name, fn in self.calls.get("shutdown", ()):
            if name == node_id:
                try:
                    fn()
                except Exception as exc:
                    self.log.error(
                        "switched-off node's shutdown failed", node=node_id, error=repr(exc)
                    )
