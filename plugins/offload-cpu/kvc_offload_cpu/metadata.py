"""What the two halves tell each other (picklable, no torch).

Scheduler -> worker: :class:`OffloadMetadata`, one per step, through
``build_connector_meta`` / ``bind_connector_metadata``.
Worker -> scheduler: :class:`OffloadWorkerMeta`, through
``build_connector_worker_meta`` / ``update_connector_output``; vLLM combines
the workers' objects with :meth:`OffloadWorkerMeta.aggregate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Transfer:
    """Blocks of one request to copy: ``slots[i]`` <-> block ``block_ids[i]`` (group ``groups[i]``).

    A slot holds one KV cache group's block (with one group: every layer's page).
    """

    req_id: str
    slots: list[int] = field(default_factory=list)
    #: Slot generation each slot must hold (loads) or will hold (saves).
    gens: list[int] = field(default_factory=list)
    #: The vLLM block id of each slot.
    block_ids: list[int] = field(default_factory=list)
    #: The KV cache group of each slot's block.
    groups: list[int] = field(default_factory=list)
    #: Position of each block in the request (block index), for error reports.
    positions: list[int] = field(default_factory=list)

    def add(self, slot: int, gen: int, block_id: int, group: int, position: int) -> None:
        self.slots.append(slot)
        self.gens.append(gen)
        self.block_ids.append(block_id)
        self.groups.append(group)
        self.positions.append(position)

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class OffloadMetadata:
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    #: Finished requests whose blocks vLLM holds until this node's saves of them are done.
    hold: list[str] = field(default_factory=list)
    #: Requests preempted this step: their blocks are about to be reused.
    preempted: list[str] = field(default_factory=list)
    #: Loads run through vLLM's async-load protocol (reported via get_finished).
    async_loads: bool = False

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.hold or self.preempted)


SlotGen = tuple[int, int]


@dataclass
class OffloadWorkerMeta:
    """One step's results from one worker, or several workers' combined."""

    #: (slot, generation) -> how many workers finished saving it.
    saved: dict[SlotGen, int] = field(default_factory=dict)
    #: Saves that did not happen (the scheduler drops those entries).
    save_failed: set[SlotGen] = field(default_factory=set)
    #: Request id -> how many workers finished its loads (either way).
    loaded: dict[str, int] = field(default_factory=dict)
    #: Slots found corrupt or overwritten at load time (the scheduler drops them).
    load_failed: set[SlotGen] = field(default_factory=set)
    #: Request id -> first block position that failed to load (vLLM recomputes from there).
    req_load_failed: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: OffloadWorkerMeta) -> OffloadWorkerMeta:
        out = OffloadWorkerMeta(
            saved=dict(self.saved),
            save_failed=self.save_failed | other.save_failed,
            loaded=dict(self.loaded),
            load_failed=self.load_failed | other.load_failed,
            req_load_failed=dict(self.req_load_failed),
        )
        for key, n in other.saved.items():
            out.saved[key] = out.saved.get(key, 0) + n
        for req, n in other.loaded.items():
            out.loaded[req] = out.loaded.get(req, 0) + n
        for req, pos in other.req_load_failed.items():
            old = out.req_load_failed.get(req)
            out.req_load_failed[req] = pos if old is None else min(old, pos)
        return out

    def is_empty(self) -> bool:
        return not (
            self.saved
            or self.save_failed
            or self.loaded
            or self.load_failed
            or self.req_load_failed
        )
