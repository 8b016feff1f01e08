"""Per-tenant quotas (``quotas``, keyed by vLLM's ``cache_salt``) and a request's
``kv_retention``, in the tier's own index and in its simulator model (the same code):
who evicts whom at every capacity, bad quotas refused before launch, and the three
traces the issue names, predicted: two tenants, think-time sessions, a pinned prefix."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from kvc_offload_cpu.index import OTHERS, BlockIndex, Entry

from composer.cli import main
from composer.controls import Retention
from composer.simulate import Result, simulate
from composer.testing.policy_traces import pinned_prefix, sessions, two_tenants
from composer.trace import TraceRequest, multi_turn, read_trace, write_trace
from composer.validation import load_pipeline


def _fill(index: BlockIndex, tenant: str, keys: list[bytes]) -> list[Entry]:
    out = []
    for key in keys:
        entry = index.allocate(key, tenant)
        assert entry is not None, key
        index.mark_ready(entry)
        out.append(entry)
    return out


def _keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def test_a_tenant_at_its_share_evicts_its_own_blocks_first() -> None:
    index = BlockIndex(10, "lru", quotas={"chat": 0.5})
    chat = _fill(index, "chat", _keys("c", 5))
    _fill(index, "scan", _keys("s", 5))  # "scan" is not named: it counts as OTHERS
    assert index.quotas is not None and index.quotas.held == {"chat": 5, OTHERS: 5}
    # chat's blocks are the least recently used, yet the scan evicts its own.
    _fill(index, "scan", _keys("t", 20))
    assert all(e.key in index for e in chat)
    assert index.quotas.evicted == {OTHERS: 20}
    # chat, at its share, also evicts its own (the oldest of them).
    _fill(index, "chat", [b"c5"])
    assert b"c0" not in index and index.quotas.held == {"chat": 5, OTHERS: 5}


def test_free_slots_are_anyones_and_a_tenant_within_its_share_takes_from_one_past_it() -> None:
    index = BlockIndex(10, "lru", quotas={"chat": 0.5, "batch": 0.2})
    scan = _fill(index, "", _keys("s", 10))  # no salt: OTHERS (0.3 of the pool), and all free
    assert index.quotas is not None and index.quotas.past() == {OTHERS}
    _fill(index, "chat", _keys("c", 5))
    # chat took from OTHERS (past its share), oldest first.
    assert [e.key in index for e in scan] == [False] * 5 + [True] * 5
    _fill(index, "batch", _keys("b", 2))
    assert index.quotas.held == {"chat": 5, "batch": 2, OTHERS: 3}
    # Nobody past now: batch, at its share, evicts its own only.
    _fill(index, "batch", [b"b2"])
    assert b"b0" not in index and index.quotas.held["batch"] == 2


def test_a_tenant_at_its_share_with_nothing_to_give_saves_nothing() -> None:
    index = BlockIndex(4, "lru", quotas={"a": 0.5, "b": 0.5})
    a = _fill(index, "a", _keys("a", 2))
    _fill(index, "b", _keys("b", 2))
    for entry in a:
        index.pin(entry)  # a load reads them
    assert index.allocate(b"a2", "a") is None  # b is within its share: never its blocks
    index.unpin(a[0])
    assert index.allocate(b"a2", "a") is not None and b"a0" not in index


def test_quotas_and_retention_together_keep_a_ttl_and_evict_the_tenants_next_block() -> None:
    now = [0.0]
    index = BlockIndex(4, "lru", retention="request", quotas={"a": 0.5}, clock=lambda: now[0])
    a = _fill(index, "a", _keys("a", 2))
    _fill(index, "b", _keys("b", 2))
    assert index.retain(a[0], Retention(ttl_s=10))
    _fill(index, "a", [b"a2"])  # a at its share: its own oldest not kept goes
    assert b"a0" in index and b"a1" not in index
    now[0] = 11.0
    _fill(index, "a", [b"a3"])
    assert b"a0" not in index


@pytest.mark.parametrize("slots", [1, 2, 3, 7, 16, 40])
@pytest.mark.parametrize(
    "shares",
    [{"a": 0.5}, {"a": 0.3, "b": 0.3}, {"a": 0.25, "b": 0.25, OTHERS: 0.5}, {"a": 1.0}],
    ids=lambda s: "+".join(f"{k}{v}" for k, v in s.items()),
)
def test_a_tenant_within_its_share_loses_no_block_to_another(
    slots: int, shares: dict[str, float]
) -> None:
    """Random saves, touches, pins and drops of four tenants: after every step the held
    counts are the blocks indexed, and every eviction took a block of the saving
    tenant or of one past its share (or, with nobody past, any: rounding's slack)."""
    rng = random.Random(slots * 7919 + len(shares))
    index = BlockIndex(slots, "lru", quotas=shares)
    quotas = index.quotas
    assert quotas is not None
    pinned: list[Entry] = []
    for step in range(600):
        tenant = rng.choice(["a", "b", "c", ""])
        owner = quotas.of(tenant)
        held_before, past = Counter(quotas.held), quotas.past()
        before = {e.key: e.tenant for e in index.entries()}
        key = f"{step}".encode()
        entry = index.allocate(key, tenant)
        if entry is not None:
            index.mark_ready(entry)
            gone = set(before) - {e.key for e in index.entries()}
            for lost in gone:
                victim = before[lost]
                assert (
                    victim == owner
                    or victim in past
                    or (not past and held_before[owner] < quotas.limit[owner])
                ), (step, owner, victim, held_before, quotas.limit)
            if rng.random() < 0.1:
                index.pin(entry)
                pinned.append(entry)
        if pinned and rng.random() < 0.2:
            index.unpin(pinned.pop(rng.randrange(len(pinned))))
        if rng.random() < 0.05 and index.entries():
            index.drop(rng.choice(index.entries()))
        held = Counter(e.tenant for e in index.entries())
        assert +quotas.held == held, step
        assert len(index) <= slots


@pytest.mark.parametrize(
    ("quotas", "message"),
    [
        ("{chat: 0.7, scan: 0.5}", "quotas: the shares sum to 120%; at most 100%"),
        ("{chat: 0.5, '*': 0.6}", "quotas: the shares sum to 110%"),
        ("{chat: 0}", "quotas.chat: input should be greater than 0"),
        ("{chat: 1.5}", "quotas.chat: input should be less than or equal to 1"),
        ("{chat: .nan}", "quotas.chat: expected a finite number"),
        ("{chat: lots}", "quotas.chat: expected a number"),
        ("[chat]", "quotas: expected a mapping"),
        ("{'': 0.5}", "tenant '': expected a non-empty string"),
        ("{a/b: 0.5}", "tenant 'a/b': must not contain '@', '/'"),
        (f"{{{'t' * 129}: 0.5}}", "expected at most 128 characters"),
    ],
)
def test_bad_quotas_are_located_errors_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quotas: str, message: str
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n    config:\n"
        f"      capacity: 1MiB\n      quotas: {quotas}\n"
    )
    assert main(["validate", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out.startswith(f"{path}:7:") and message in out.out, out
    assert "Traceback" not in out.out + out.err


# -- the traces, predicted ---------------------------------------------------- #

BLOCK = 32
SLOT = 1024  # bytes of one block: the capacity below is in blocks


def _simulate(trace: list[TraceRequest], blocks: int, **config: object) -> Result:
    nodes = {"cpu": {"plugin": "offload-cpu", "config": {"capacity": blocks * SLOT, **config}}}
    pipeline = load_pipeline({"version": 1, "nodes": nodes})
    return simulate(
        pipeline,
        trace,
        bytes_per_block=SLOT,
        block_size=BLOCK,
        trace_block_tokens=BLOCK,
        exact=True,
    )


TRACES = Path(__file__).parent / "data" / "traces"
CONVERSATIONS = TRACES / "mooncake-conversation_trace-500.jsonl"


def test_with_quotas_the_chat_tenant_keeps_its_solo_hit_rate_and_without_them_not() -> None:
    chat, mixed, blocks, quota = two_tenants(multi_turn(read_trace(CONVERSATIONS)))
    solo = _simulate(chat, blocks).fraction_served
    shared = _simulate(mixed, blocks).tenants["chat"].fraction_served
    guarded = _simulate(mixed, blocks, quotas={"chat": quota}).tenants["chat"].fraction_served
    assert solo > 0.3, solo
    assert abs(guarded - solo) <= 0.02, (solo, guarded)
    assert solo - shared > 0.02, (solo, shared)


def test_a_ttl_keeps_a_sessions_prefix_through_its_think_time_and_lru_does_not() -> None:
    with_ttl, without, blocks = sessions(think_s=4.0)
    short, _, _ = sessions(think_s=4.0, ttl_s=1.0)  # it ends before the pause's noise
    kept = _simulate(with_ttl, blocks).tenants["agent"].fraction_served
    lost = _simulate(without, blocks).tenants["agent"].fraction_served
    expired = _simulate(short, blocks).tenants["agent"].fraction_served
    assert lost < 0.05 < kept and expired < 0.05, (kept, lost, expired)


def test_a_pinned_prefix_survives_memory_pressure_and_an_unpinned_one_does_not() -> None:
    pinned, unpinned, blocks = pinned_prefix()
    kept = _simulate(pinned, blocks).tenants["app"].fraction_served
    lost = _simulate(unpinned, blocks).tenants["app"].fraction_served
    assert lost < 0.05 < kept, (kept, lost)


def test_kvc_simulate_reports_each_tenant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept, _, blocks = sessions()
    trace = tmp_path / "sessions.jsonl"
    write_trace(trace, kept)
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        "version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n"
        f"    config: {{capacity: {blocks * SLOT}}}\n"
    )
    options = ["--bytes-per-block", str(SLOT), "--trace-block-tokens", "32", "--exact"]
    assert main(["simulate", str(pipeline), str(trace), *options]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("agent", "batch"))
    }
    expected = _simulate(kept, blocks).tenants
    assert rows["agent"][-1] == f"{100 * expected['agent'].fraction_served:.1f}%"
    assert rows["batch"][-1] == "0.0%" and rows["agent"][1] == "6"
