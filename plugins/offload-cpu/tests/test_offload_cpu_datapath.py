"""The host pool: copies never wait for the prefault; checksums catch every kind of bad slot."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from kvc_offload_cpu.datapath import HostPool, RegionPlan, checksums, populate
from offload_cpu_fakes import BLOCK, SLOT, Engine, canonical, content, prompt

#: Hang guard only (a copy stuck behind the stalled prefault never returns); no timing asserted.
HANG_S = 60.0


def _plans(caches: Any) -> list[RegionPlan]:
    plans, off = [], 0
    for rid in caches.groups[0].region_ids:
        t = caches.regions[rid].tensor
        plans.append(RegionPlan(frozenset({0}), t, off, int(t.shape[1])))
        off += int(t.shape[1])
    return plans


def _random_caches(num_blocks: int, layout: str, seed: int = 0) -> Any:
    caches, _ = canonical(num_blocks, layout)
    g = torch.Generator().manual_seed(seed)
    for r in caches.regions:
        r.tensor.copy_(torch.randint(-128, 128, r.tensor.shape, generator=g, dtype=torch.int8))
    return caches


def _blocks(caches: Any, ids: list[int]) -> torch.Tensor:
    return torch.cat([r.tensor[ids] for r in caches.regions], dim=1)


def _in_thread(fn: Callable[[], object]) -> None:
    """Run ``fn`` and fail (instead of hanging the run) if it never returns."""
    errors: list[BaseException] = []

    def go() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(HANG_S)
    assert not th.is_alive(), "a copy waited for the stalled prefault"
    if errors:
        raise errors[0]


class StalledPrefault:
    """Replaces ``HostPool._populate``: the prefault maps chunks until told to stall, then
    waits inside its call (holding whatever it holds) until released."""

    def __init__(self, stall_after: int = 0) -> None:
        self.stall_after = stall_after
        self.calls = 0
        self.inside = threading.Event()
        self.release = threading.Event()

    def __call__(self, t: torch.Tensor, start: int, end: int) -> None:
        if self.calls >= self.stall_after:
            self.inside.set()
            self.release.wait()
        self.calls += 1
        populate(t, start, end)


@pytest.fixture
def stalled(monkeypatch: pytest.MonkeyPatch) -> Iterator[StalledPrefault]:
    stall = StalledPrefault()
    monkeypatch.setattr(HostPool, "_populate", stall)
    yield stall
    stall.release.set()


# -- prefault --------------------------------------------------------------- #


@pytest.mark.parametrize("num_slots", [1, 2, 3, 7, 64, 257, 1000])
@pytest.mark.parametrize("layout", ["block", "layer"])
def test_saves_and_loads_never_wait_for_the_prefault(
    num_slots: int, layout: str, stalled: StalledPrefault
) -> None:
    """Any capacity: the prefault is stuck inside its first chunk (the slots the index
    hands out first), and saves and loads of those and the last slots complete."""
    caches = _random_caches(64, layout)
    pool = HostPool(_plans(caches), num_slots, pin=False)
    done = threading.Event()
    errors: list[BaseException | None] = []

    def on_done(seconds: float | None, error: BaseException | None) -> None:
        errors.append(error)
        done.set()

    pool.start_prefault(on_done)
    assert stalled.inside.wait(HANG_S)
    assert pool.faulted_slots == 0
    slots = sorted({0, num_slots // 2, num_slots - 1})
    src = list(range(1, 1 + len(slots)))
    expect = _blocks(caches, src)
    dst = list(range(40, 40 + len(slots)))

    def copies() -> None:
        pool.save(slots, src, [0] * len(slots), with_checksums=True)
        ok, _ = pool.load(slots, dst, [0] * len(slots), verify=True)
        assert all(ok)

    _in_thread(copies)
    assert torch.equal(_blocks(caches, dst), expect)
    assert pool.faulted_slots == 0  # the prefault really was still stuck
    stalled.release.set()
    assert done.wait(HANG_S)
    assert errors == [None] and pool.faulted_slots == num_slots
    # The prefault went over the saved slots afterwards and kept their bytes.
    for r in caches.regions:
        r.tensor[dst] = 0
    ok, _ = pool.load(slots, dst, [0] * len(slots), verify=True)
    assert all(ok) and torch.equal(_blocks(caches, dst), expect)


@pytest.mark.parametrize("layout", ["block", "layer"])
def test_prefault_keeps_bytes_saved_beside_it(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves land in every chunk while the prefault is part-way (before, in and after it)."""
    stall = StalledPrefault(stall_after=3)  # chunks of one slot: stuck in slot 1 to 3
    monkeypatch.setattr(HostPool, "_populate", stall)
    caches = _random_caches(64, layout)
    pool = HostPool(_plans(caches), 40, pin=False)
    th = threading.Thread(target=pool.prefault, kwargs={"chunk_bytes": 1}, daemon=True)
    th.start()
    try:
        assert stall.inside.wait(HANG_S)
        slots = list(range(40))
        src = [1 + i for i in range(40)]
        _in_thread(lambda: pool.save(slots, src, [0] * len(slots), with_checksums=True))
    finally:
        stall.release.set()
    th.join(HANG_S)
    assert pool.faulted_slots == 40
    ok, _ = pool.load(slots, list(range(1, 41)), [0] * len(slots), verify=True)
    assert all(ok)
    assert torch.equal(pool.slot(39), _blocks(caches, [40])[0])


def test_prefault_stops_on_request(stalled: StalledPrefault) -> None:
    caches = _random_caches(8, "block")
    pool = HostPool(_plans(caches), 4, pin=False)
    pool.start_prefault(chunk_bytes=1)  # one slot per chunk
    assert stalled.inside.wait(HANG_S)
    stop = threading.Thread(target=pool.stop_prefault, daemon=True)
    stop.start()
    stalled.release.set()
    stop.join(HANG_S)
    assert not stop.is_alive()
    assert pool.faulted_slots == 1  # it finished the chunk it was in, and no other


@pytest.mark.parametrize("slots_in_pool", [1, 3, 8, 64, 500])
@pytest.mark.parametrize("load_mode", ["sync", "async"])
def test_the_next_request_hits_while_the_prefault_is_stalled(
    slots_in_pool: int, load_mode: str, stalled: StalledPrefault
) -> None:
    """The worker with background saves: a finished request's blocks are released as soon
    as its save is done, and the same prompt right after is served by the tier."""
    eng = Engine(save_mode="async", load_mode=load_mode, capacity=slots_in_pool * SLOT)
    assert stalled.inside.wait(HANG_S)
    p = prompt(31, 100)  # 3 full blocks
    want = min(3, slots_in_pool)

    held: list[bool] = []

    def first_request() -> None:
        eng.add("a", p)
        eng.prefill("a")
        held.append(eng.finish("a"))  # held while its save may still read its blocks
        eng.settle(1)  # waits for the save, then one step reports it

    _in_thread(first_request)
    assert not eng.held and ("a" in eng.finished_sending) == held[0]
    ext, is_async = eng.add("b", p)
    assert ext == want * BLOCK and is_async == (load_mode == "async")
    if load_mode == "sync":
        _in_thread(lambda: eng.prefill("b"))
    else:

        def load_async() -> None:
            eng.step()  # the load starts; vLLM keeps the request waiting
            eng.worker.drain()
            eng.step()

        _in_thread(load_async)
        assert "b" in eng.finished_recving
    assert not eng.errors
    for b in range(want):
        assert torch.equal(eng.block_bytes("b", b), content(p, b))
    assert eng.pool.faulted_slots == 0  # all of it ran beside the stuck prefault
    stalled.release.set()
    _in_thread(eng.worker.shutdown)
    assert eng.pool.faulted_slots == eng.pool.num_slots or eng.pool._prefault_stop.is_set()


# -- checksums -------------------------------------------------------------- #

N = 8  # slots saved


def _write(pool: HostPool, slot: int, data: torch.Tensor) -> None:
    off = 0
    for p in pool.pools:
        w = int(p.shape[1])
        p[slot] = data[off : off + w]
        off += w


class Saved:
    """Blocks ``A`` saved into slots 0..N-1 and overwritten by blocks ``B`` (the live ones)."""

    def __init__(self, layout: str) -> None:
        self.caches = _random_caches(64, layout, seed=5)
        self.pool = HostPool(_plans(self.caches), 2 * N, pin=False)
        self.slots = list(range(N))
        self.pool.save(
            self.slots, list(range(1, 1 + N)), [0] * len(self.slots), with_checksums=True
        )
        self.old = [self.pool.slot(s) for s in self.slots]
        self.pool.save(
            self.slots, list(range(20, 20 + N)), [0] * len(self.slots), with_checksums=True
        )
        self.good = [self.pool.slot(s) for s in self.slots]
        self.sums = list(self.pool.sums)

    def restore(self) -> None:
        for s in self.slots:
            _write(self.pool, s, self.good[s])
        self.pool.sums[:] = type(self.pool.sums)("Q", self.sums)

    def bad_slots(self) -> set[int]:
        ok, _ = self.pool.load(
            self.slots, list(range(40, 40 + N)), [0] * len(self.slots), verify=True
        )
        return {s for s, good in zip(self.slots, ok, strict=True) if not good}

    def word(self, slot: int, i: int) -> int:
        return int(self.good[slot].view(torch.int64)[i])


def _offsets() -> list[int]:
    g = torch.Generator().manual_seed(9)
    edge = [0, 1, 7, 8, SLOT // 2 - 1, SLOT // 2, SLOT // 2 + 1, SLOT - 8, SLOT - 1]
    return edge + torch.randint(0, SLOT, (24,), generator=g).tolist()


@pytest.fixture(params=["block", "layer"])
def saved(request: pytest.FixtureRequest) -> Saved:
    return Saved(request.param)


def test_every_single_bit_flip_is_caught(saved: Saved) -> None:
    assert saved.bad_slots() == set()
    for k, off in enumerate(_offsets()):
        slot = k % N
        for bit in range(8):
            data = saved.good[slot].clone()
            data[off] ^= torch.tensor(1 << bit, dtype=torch.uint8).view(torch.int8)
            _write(saved.pool, slot, data)
            assert saved.bad_slots() == {slot}, (off, bit)
            saved.restore()


def test_compensating_and_swapped_words_are_caught(saved: Saved) -> None:
    """What the old wrapping sum of words passed: +1/-1 in two words, two words swapped."""
    words = SLOT // 8
    pairs = [(0, 1), (0, words - 1), (3, words // 2), (words // 2 - 1, words // 2), (10, 900)]
    for k, (i, j) in enumerate(pairs):
        slot = k % N
        data = saved.good[slot].clone()
        w = data.view(torch.int64)
        w[i] += 1
        w[j] -= 1
        _write(saved.pool, slot, data)
        assert saved.bad_slots() == {slot}, ("+1/-1", i, j)
        saved.restore()
        data = saved.good[slot].clone()
        w = data.view(torch.int64)
        assert int(w[i]) != int(w[j])
        w[i], w[j] = saved.word(slot, j), saved.word(slot, i)
        _write(saved.pool, slot, data)
        assert saved.bad_slots() == {slot}, ("swap", i, j)
        saved.restore()


def test_moved_zeroed_truncated_and_stale_slots_are_caught(saved: Saved) -> None:
    pool = saved.pool
    # Two slots' blocks swapped, alone and together with their checksums.
    _write(pool, 1, saved.good[2])
    _write(pool, 2, saved.good[1])
    assert saved.bad_slots() == {1, 2}
    pool.sums[1], pool.sums[2] = saved.sums[2], saved.sums[1]
    assert saved.bad_slots() == {1, 2}
    saved.restore()
    # A block copied over another slot, with its checksum.
    _write(pool, 4, saved.good[3])
    pool.sums[4] = saved.sums[3]
    assert saved.bad_slots() == {4}
    saved.restore()
    _write(pool, 5, torch.zeros(SLOT, dtype=torch.int8))
    assert saved.bad_slots() == {5}
    saved.restore()
    for cut in (8, SLOT // 2, SLOT - 8):  # the new block written only up to ``cut``
        data = saved.good[6].clone()
        data[cut:] = saved.old[6][cut:]
        _write(pool, 6, data)
        assert saved.bad_slots() == {6}, cut
        saved.restore()
    _write(pool, 7, saved.old[7])  # the slot's previous block, whole
    assert saved.bad_slots() == {7}
    saved.restore()
    # A slot never saved with a checksum.
    ok, _ = pool.load([N], [40], [0] * len([N]), verify=True)
    assert ok == [False]
    assert saved.bad_slots() == set()


def test_checksums_cover_every_region_and_depend_on_the_seed() -> None:
    a = torch.randint(-128, 128, (3, 64), dtype=torch.int8)
    b = torch.randint(-128, 128, (3, 32), dtype=torch.int8)
    base = checksums([a, b], [0, 1, 2])
    assert len(set(base)) == 3
    assert checksums([a, b], [5, 1, 2])[0] != base[0]
    b2 = b.clone()
    b2[1, 31] ^= 1
    assert checksums([a, b2], [0, 1, 2]) == [base[0], checksums([a, b2], [0, 1, 2])[1], base[2]]
    assert checksums([a, b2], [0, 1, 2])[1] != base[1]
