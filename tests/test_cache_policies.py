"""Cache policies as plugins (``composer.policy``): the built-ins on the specs, a policy in
one file (``examples/cache_policy_fifo.py``, the docs' example) chosen by name, every bad
name and bad registration refused with a located or named error, and a policy that
raises losing no block."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kvc_offload_cpu.index import Admission, BlockIndex

from composer.builtin_policies import Arc, Lru, RequestRetention, Threshold
from composer.cli import main
from composer.controls import Retention, controls_of
from composer.discovery import MODULES_ENV, discover, find_policy
from composer.policy import (
    REQUIRED,
    SPECS,
    AdmissionPolicy,
    CachePolicy,
    EvictionPolicy,
    RetentionPolicy,
)
from composer.validation import load_pipeline

ROOT = Path(__file__).resolve().parents[1]
FIFO = ROOT / "examples" / "cache_policy_fifo.py"
DOCS = ROOT / "docs" / "cache-policies.md"


@pytest.fixture
def fifo(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The docs' example policy, importable as ``fifo`` and named in the plugin modules."""
    spec = importlib.util.spec_from_file_location("fifo", FIFO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "fifo", module)
    monkeypatch.setenv(MODULES_ENV, "fifo")
    yield module


def _pipeline(tmp_path: Path, **config: Any) -> Path:
    lines = "".join(f"      {k}: {v}\n" for k, v in config.items())
    path = tmp_path / "p.yaml"
    path.write_text(
        "version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n    config:\n"
        f"      capacity: 1MiB\n{lines}"
    )
    return path


def test_the_built_ins_are_registered_on_their_specs() -> None:
    policies = discover().policies
    assert {(p.name, p.kind, p.cls) for p in policies.values()} >= {
        ("lru", "eviction", Lru),
        ("arc", "eviction", Arc),
        ("threshold", "admission", Threshold),
    }
    assert all(p.package == "kv-composer" for p in policies.values() if p.cls in (Lru, Arc))


class _Block:
    def __init__(self, key: bytes, size: int = 1) -> None:
        self.key = key
        self.size = size


def _order(policy: EvictionPolicy) -> list[bytes]:
    return [b.key for b in policy.victims()]


def test_lru_puts_a_touched_block_last_and_arc_keeps_a_reused_block_through_a_scan() -> None:
    blocks = {k: _Block(k) for k in (b"a", b"b", b"c")}
    lru = Lru(3)
    for block in blocks.values():
        lru.added(block)
    lru.touched(blocks[b"a"])
    assert _order(lru) == [b"b", b"c", b"a"]
    lru.removed(blocks[b"b"], evicted=True)
    assert _order(lru) == [b"c", b"a"]
    arc = Arc(2)
    arc.added(blocks[b"a"])
    arc.touched(blocks[b"a"])  # seen again: the reused list
    arc.added(blocks[b"b"])
    assert _order(arc)[0] == b"b"  # the seen-once block goes first
    arc.removed(blocks[b"b"], evicted=True)
    assert b"b" in arc.b1  # remembered: if it comes back, recency grows


def test_arc_measures_its_lists_in_slots() -> None:
    """A hybrid's entry takes several slots: arc's ghost lists hold a pool's worth of
    slots, and its target grows by the slots of the block that came back."""
    a, b, c = _Block(b"a", 3), _Block(b"b", 3), _Block(b"c", 3)
    arc = Arc(6)
    arc.added(a)
    arc.added(b)
    arc.removed(a, evicted=True)
    assert arc.g1 == 3 and arc.n1 == 3
    arc.added(a)  # back from b1: p grows by its 3 slots
    assert arc.p == 3 and arc.n2 == 3 and not arc.b1
    arc.removed(b, evicted=True)
    arc.added(c)
    arc.removed(c, evicted=True)
    assert list(arc.b1) == [b"b", b"c"] and arc.g1 == 6
    arc.added(_Block(b"d", 3))  # t1 3 + b1 6 slots > the pool's 6: the oldest ghost goes
    assert list(arc.b1) == [b"c"]
    assert _order(arc)[0] == b"a"  # t1 holds 3 slots, not more than p: t2 first


def test_a_pin_cap_counts_slots() -> None:
    policy = RequestRetention(8, type("C", (), {"max_pinned_share": 0.5})())  # 4 slots
    pin = Retention(pin=True)
    wide, small = _Block(b"w", 3), _Block(b"s", 2)
    assert policy.requested(wide, pin, 0.0) and not policy.requested(small, pin, 0.0)
    policy.requested(wide, Retention(pin=False), 0.0)
    assert policy.requested(small, pin, 0.0) and policy.pinned_slots == 2


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_threshold_admits_the_blocks_enough_requests_contained(threshold: int) -> None:
    config = type("C", (), {"store_threshold": threshold})()
    policy = Threshold(8, config)
    keys = [b"a", b"b", b"c"]
    admitted = [policy.admit(keys) for _ in range(3)]
    # The n-th request containing the blocks admits them once n >= threshold.
    assert admitted == [3 if n + 1 >= threshold else 0 for n in range(3)]
    assert policy.admit([b"a", b"new"]) == (2 if threshold == 1 else 1)


def test_a_policy_in_one_file_is_chosen_by_name(fifo: ModuleType, tmp_path: Path) -> None:
    pipeline = load_pipeline(_pipeline(tmp_path, eviction="fifo"))
    assert pipeline.nodes[0].config.eviction == "fifo"  # type: ignore[attr-defined]
    index = BlockIndex(2, "fifo")
    assert type(index.policy).__name__ == "Fifo"
    a, b = index.allocate(b"a"), index.allocate(b"b")
    assert a is not None and b is not None
    index.mark_ready(a)
    index.mark_ready(b)
    index.touch(a)  # a hit: fifo does not care
    c = index.allocate(b"c")
    assert c is not None and c.slots == a.slots and b"a" not in index


def test_the_simulator_runs_the_named_policy(fifo: ModuleType, tmp_path: Path) -> None:
    """``kvc simulate`` builds the tier's own index: fifo and lru part ways on a hit."""
    from kvc_offload_cpu.config import OffloadCPUConfig
    from kvc_offload_cpu.simulate import OffloadCPUModel

    served = {}
    for eviction in ("lru", "fifo"):
        config = OffloadCPUConfig(capacity=2 * 64, eviction=eviction)
        tier = OffloadCPUModel(config, block_size=4, bytes_per_block=64)
        for key in (b"a", b"b"):
            tier.save([key], 4, 0)
        tier.load([b"a"], 0, tier.lookup([b"a"], 0, 1))  # a hit on a
        tier.save([b"c"], 4, 0)  # full: one goes
        served[eviction] = tier.lookup([b"a"], 0, 1)
    assert served == {"lru": 1, "fifo": 0}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"eviction": "lur"},
            'p.yaml:7:17: nodes.cpu.config.eviction: unknown eviction policy "lur" '
            '(did you mean "lru"?); eviction policies: "arc", "lru"',
        ),
        (
            {"eviction": "threshold"},
            'nodes.cpu.config.eviction: "threshold" is an admission policy; '
            'eviction policies: "arc", "lru"',
        ),
        (
            {"admission": "lru"},
            'nodes.cpu.config.admission: "lru" is an eviction policy; '
            'admission policies: "threshold"',
        ),
        ({"admission": "'1'"}, 'unknown admission policy "1"'),
    ],
)
def test_a_policy_no_package_provides_is_a_located_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    config: dict[str, str],
    message: str,
) -> None:
    _pipeline(tmp_path, **config)
    monkeypatch.chdir(tmp_path)
    code = main(["validate", "p.yaml"])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert message in out + err and "Traceback" not in out + err


def _registering(*policies: object) -> ModuleType:
    module = ModuleType("bad_policies")

    def register_cache_policies(register: Any) -> None:
        for policy in policies:
            register(policy)

    from composer import hookimpl

    module.register_cache_policies = hookimpl(register_cache_policies)  # type: ignore[attr-defined]
    return module


class _NoVictims(EvictionPolicy):
    def added(self, block: Any) -> None: ...

    def removed(self, block: Any, evicted: bool) -> None: ...


@pytest.mark.parametrize(
    ("registered", "name", "message"),
    [
        ("not a policy", "", "registered str, not a CachePolicy"),
        (CachePolicy("", "eviction", Lru), "", "a non-empty string name"),
        (CachePolicy("x", "tiering", Lru), "x", "kind must be one of"),  # type: ignore[arg-type]
        (CachePolicy("x", "admission", Lru), "x", "must subclass AdmissionPolicy"),
        (CachePolicy("x", "eviction", _NoVictims), "x", "_NoVictims lacks victims"),
        (CachePolicy("lru", "eviction", Lru), "lru", "registered 2 times"),
    ],
)
def test_a_bad_registration_is_kept_aside_with_its_problem(
    registered: Any, name: str, message: str
) -> None:
    """Discovery goes on (every other policy, every command works); the registration is
    named with its problem, and a pipeline naming it is refused
    (tests/test_policy_plugins.py: located, with the package and the way out)."""
    registry = discover(extra=[_registering(registered)])
    (broken,) = registry.broken_policies
    assert (broken.name, message in broken.problem) == (name, True), broken
    assert name not in registry.policies and "arc" in registry.policies
    with pytest.raises(LookupError, match=re.escape(message)):
        registry.policy("eviction", name or "x")


class _Raising(EvictionPolicy):
    """Orders like lru until ``fail_in`` is called."""

    fail_in = ""

    def __init__(self, slots: int, config: Any = None) -> None:
        super().__init__(slots, config)
        self.inner = Lru(slots)

    def _maybe_fail(self, method: str) -> None:
        if method == self.fail_in:
            raise RuntimeError(f"policy bug in {method}")

    def added(self, block: Any) -> None:
        self._maybe_fail("added")
        self.inner.added(block)

    def touched(self, block: Any) -> None:
        self._maybe_fail("touched")
        self.inner.touched(block)

    def victims(self) -> Iterator[Any]:
        self._maybe_fail("victims")
        return self.inner.victims()

    def removed(self, block: Any, evicted: bool) -> None:
        self._maybe_fail("removed")
        self.inner.removed(block, evicted)


@pytest.mark.parametrize("method", [m for m in ("added", "touched", "victims", "removed")])
def test_an_eviction_policy_that_raises_loses_no_block(method: str) -> None:
    policy = _Raising(3)
    index = BlockIndex(3, policy)
    entries = []
    for key in (b"a", b"b", b"c"):
        entry = index.allocate(key)
        assert entry is not None
        index.mark_ready(entry) if key != b"c" else None
        entries.append(entry)
    policy.fail_in = method
    index.touch(entries[0])
    index.mark_ready(entries[2])
    index.drop(entries[1])  # removed: a dropped block
    d = index.allocate(b"d")  # victims: a free slot (b's)
    e = index.allocate(b"e")  # victims: full, one goes
    assert d is not None and e is not None
    assert index.health.fallbacks["eviction"].reason.startswith(
        f"_Raising.{method} raised RuntimeError"
    )
    assert type(index.policy) is Lru
    # Every block is where the index says: indexed, or evicted and counted.
    assert len(index) + index.evictions == 4 and index.used_slots == 3
    for entry in index.entries():
        assert index.current(entry.slots[0], entry.gen) is entry


def test_an_admission_policy_that_raises_admits_every_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admission = Admission("threshold", 8, type("C", (), {"store_threshold": 2})())
    assert admission.admit([b"a", b"b"]) == 0

    def broken(keys: Sequence[bytes]) -> int:
        raise ValueError("policy bug")

    assert admission.policy is not None
    monkeypatch.setattr(admission.policy, "admit", broken)
    assert admission.admit([b"a", b"b", b"c"]) == 3
    assert admission.failed == "Threshold.admit raised ValueError: policy bug"
    assert admission.admit([b"x"]) == 1  # and from then on


def test_find_policy_sees_the_modules_the_environment_names(
    fifo: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert find_policy("eviction", "fifo").__name__ == "Fifo"
    monkeypatch.delenv(MODULES_ENV)
    with pytest.raises(LookupError, match='unknown eviction policy "fifo"'):
        find_policy("eviction", "fifo")


def test_the_docs_describe_every_method_of_every_spec() -> None:
    text = DOCS.read_text()
    for kind, spec in SPECS.items():
        assert f"`{spec.__name__}`" in text, kind
        for name, fn in vars(spec).items():
            if inspect.isfunction(fn) and not name.startswith("_"):
                args = ", ".join(list(inspect.signature(fn).parameters)[1:])
                assert f"`{name}({args})`" in text, (kind, name)
    assert set(REQUIRED) == set(SPECS)
    assert issubclass(Threshold, AdmissionPolicy)


@pytest.mark.parametrize(
    ("retention", "error"),
    [
        ({"ttl_s": -1}, "kv_retention.ttl_s: expected seconds from 0 to 86400, got -1"),
        ({"ttl_s": 1e9}, "kv_retention.ttl_s: expected seconds from 0 to 86400"),
        ({"ttl_s": float("nan")}, "kv_retention.ttl_s: expected seconds"),
        ({"ttl_s": float("inf")}, "kv_retention.ttl_s: expected seconds"),
        ({"ttl_s": "60"}, "kv_retention.ttl_s: expected seconds"),
        ({"ttl_s": True}, "kv_retention.ttl_s: expected seconds"),
        ({"pin": "yes"}, "kv_retention.pin: expected true or false, got 'yes'"),
        ({"pin": 1}, "kv_retention.pin: expected true or false"),
        ({"priority": 1.5}, "kv_retention.priority: expected a whole number"),
        ({"priority": 10**6}, "kv_retention.priority: expected a whole number"),
        ({"ttl": 3}, "kv_retention: unknown key(s) 'ttl'; expected ttl_s, pin, priority"),
        ([1, 2], "kv_retention: expected an object {ttl_s, pin, priority}"),
        ("forever", "kv_retention: expected an object"),
    ],
)
def test_a_malformed_kv_retention_is_refused_with_its_reason(retention: Any, error: str) -> None:
    controls = controls_of({"kv_retention": retention})
    assert controls.error is not None and error in controls.error
    # As every malformed control: nothing loaded, nothing saved, nothing kept.
    assert controls.load == frozenset() and controls.store_limit("cpu") == 0
    assert controls.retention is None


def test_a_well_formed_kv_retention_is_read() -> None:
    assert controls_of({"kv_retention": {}}).retention == Retention()
    got = controls_of({"kv_retention": {"ttl_s": 90, "pin": False, "priority": -3}})
    assert got.error is None and got.retention == Retention(90.0, False, -3)


def test_request_retention_keeps_pins_under_the_cap_and_ttls_until_they_end() -> None:
    config = type("C", (), {"max_pinned_share": 0.5})()
    policy = RequestRetention(4, config)  # 2 pins
    a, b, c = _Block(b"a"), _Block(b"b"), _Block(b"c")
    pin = Retention(pin=True)
    assert policy.requested(a, pin, 0.0) and policy.requested(b, pin, 0.0)
    assert not policy.requested(c, pin, 0.0)  # over the cap
    assert policy.kept(a, 1e9) and not policy.kept(c, 0.0)
    policy.requested(a, Retention(pin=False), 0.0)
    assert not policy.kept(a, 0.0)
    policy.requested(c, Retention(ttl_s=10, priority=2), 5.0)
    policy.requested(c, Retention(ttl_s=1), 6.0)  # an earlier deadline does not shorten it
    assert policy.kept(c, 14.9) and not policy.kept(c, 15.0)
    policy.requested(a, Retention(ttl_s=10, priority=1), 0.0)
    policy.requested(c, Retention(ttl_s=10, priority=2), 0.0)
    # Only pinned and TTL'd blocks left: the lowest priority TTL goes, never a pin.
    assert policy.yields([b, c, a], 1.0) is a
    assert policy.yields([b], 1.0) is None
    policy.removed(b)
    assert not policy.kept(b, 0.0) and b.key not in policy.pinned


class _RaisingRetention(RetentionPolicy):
    def requested(self, block: Any, retention: Retention, now: float) -> bool:
        return True

    def kept(self, block: Any, now: float) -> bool:
        raise RuntimeError("retention bug")


def test_a_retention_policy_that_raises_keeps_nothing_and_loses_no_block() -> None:
    index = BlockIndex(2, "lru", retention=_RaisingRetention(2))
    for key in (b"a", b"b"):
        entry = index.allocate(key)
        assert entry is not None
        index.mark_ready(entry)
    c = index.allocate(b"c")  # kept() raises: no retention from now on, lru evicts a
    assert c is not None and b"a" not in index and b"b" in index
    assert index.retention is None
    reason = index.health.fallbacks["retention"].reason
    assert reason == "_RaisingRetention.kept raised RuntimeError: retention bug"
    assert len(index) + index.evictions == 3


class _Counting(RetentionPolicy):
    """Keeps every block a request asked for; counts the tier's questions."""

    asked: set[bytes]

    def __init__(self, slots: int, config: Any = None) -> None:
        super().__init__(slots, config)
        self.asked, self.calls = set(), 0

    def requested(self, block: Any, retention: Retention, now: float) -> bool:
        self.asked.add(block.key)
        return True

    def kept(self, block: Any, now: float) -> bool:
        self.calls += 1
        return block.key in self.asked


@pytest.mark.parametrize("asked_only", [True, False])
def test_an_asked_only_retention_policy_is_asked_nothing_until_a_request_asks(
    asked_only: bool,
) -> None:
    policy = _Counting(3)
    policy.asked_only = asked_only
    index = BlockIndex(3, "lru", retention=policy)
    entries = []
    for key in (b"a", b"b", b"c", b"d"):  # d evicts a
        entry = index.allocate(key)
        assert entry is not None
        index.mark_ready(entry)
        entries.append(entry)
    assert (policy.calls == 0) is asked_only
    assert index.retain(entries[1], Retention(ttl_s=60))  # b, now kept
    for key in (b"e", b"f"):
        entry = index.allocate(key)
        assert entry is not None
        index.mark_ready(entry)
    assert b"b" in index and b"c" not in index and b"d" not in index
    assert policy.calls > 0
