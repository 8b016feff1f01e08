"""A cache policy that raises is switched off loudly and reported truthfully.

Every hook of every kind (eviction: added, touched, victims, removed; admission:
admit; retention: requested, kept, yields, removed): the tier goes on with the
fallback (lru; every block admitted; no block kept), says so once on stderr in
one line naming the policy, the hook and the error, and reports the policy in
force (``lfu → lru after 1,203 evictions``): the index, ``kvc simulate``'s table
and JSON (``--json`` parses: logs go to stderr), and ``--strict`` exits 1. The
node's stats and ``/metrics`` are the scheduler half's
(``plugins/offload-cpu/tests/test_offload_cpu_policy_failures.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import structlog
from kvc_offload_cpu.index import BlockIndex

from composer.builtin_policies import Lru, RequestRetention
from composer.controls import Retention

#: Each failing policy in the module below: (kind, the hook that raises).
FAILING = [
    ("eviction", "added"),
    ("eviction", "touched"),
    ("eviction", "victims"),
    ("eviction", "removed"),
    ("admission", "admit"),
    ("retention", "requested"),
    ("retention", "kept"),
    ("retention", "yields"),
    ("retention", "removed"),
]
FALLBACK = {"eviction": "lru", "admission": "every block admitted", "retention": "no block kept"}

#: A plugin module of policies that work as the built-ins for three calls of one
#: method, then raise in it (registered as ``fail-<hook>``; retention's
#: ``fail-r-<hook>``, eviction's and retention's ``removed`` being two).
POLICIES = '''
from composer import CachePolicy, hookimpl
from composer.builtin_policies import Lru, RequestRetention, Threshold

BASES = {"eviction": Lru, "admission": Threshold, "retention": RequestRetention}


def failing(kind, hook):
    base = BASES[kind]

    def method(self, *args):
        self.calls += 1
        if self.calls > 3:
            raise RuntimeError(f"bug in {hook}\\nsecond line")
        return getattr(base, hook)(self, *args)

    def init(self, slots, config=None):
        base.__init__(self, slots, config)
        self.calls = 0

    name = "Fail" + kind.capitalize() + hook.capitalize()
    return type(name, (base,), {"__init__": init, hook: method})


def name_of(kind, hook):
    return f"fail-r-{hook}" if kind == "retention" else f"fail-{hook}"


@hookimpl
def register_cache_policies(register):
    for kind, hook in FAILING:
        register(CachePolicy(name_of(kind, hook), kind, failing(kind, hook)))
'''


def _name(kind: str, hook: str) -> str:
    return f"fail-r-{hook}" if kind == "retention" else f"fail-{hook}"


def _node(kind: str, hook: str) -> str:
    return f"{kind}_{hook}"


@pytest.fixture
def failing_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a ``kvc`` that finds the failing policies."""
    (tmp_path / "failing_policies.py").write_text(
        f"FAILING = {FAILING!r}\n" + textwrap.dedent(POLICIES)
    )
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "KV_COMPOSER_PLUGIN_MODULES": "failing_policies",
    }


def _pipeline(tmp_path: Path, failing: bool = True) -> Path:
    """One 8-block tier per failing policy (or one tier of the built-ins)."""
    nodes = {}
    for kind, hook in FAILING if failing else [("eviction", "lru")]:
        config: dict[str, Any] = {"capacity": "8KiB"}
        if failing:
            config[kind] = _name(kind, hook)
        nodes[_node(kind, hook)] = {"plugin": "offload-cpu", "config": config}
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({"version": 1, "nodes": nodes}))
    return path


def _trace(tmp_path: Path) -> Path:
    """30 requests on a shared 3-block prefix, 2 blocks of their own each, every one
    asking its blocks kept for an hour: a full 8-block tier where everything is kept
    (each hook of each kind called)."""
    lines = [
        {"timestamp": 1000 * i, "input_length": 5 * 512, "output_length": 64,
         "hash_ids": [0, 1, 2, 100 + i, 200 + i], "kv_retention": {"ttl_s": 3600}}
        for i in range(30)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _simulate(
    tmp_path: Path, env: dict[str, str], *flags: str, failing: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "composer.cli", "simulate", str(_pipeline(tmp_path, failing)),
         str(_trace(tmp_path)), "--bytes-per-block", "1KiB", "--trace-block-tokens", "32",
         *flags],
        capture_output=True, text=True, env=env, check=False, timeout=120,
    )


def test_kvc_simulate_json_says_the_policy_in_force_and_strict_fails(
    tmp_path: Path, failing_env: dict[str, str]
) -> None:
    done = _simulate(tmp_path, failing_env, "--json", "--strict")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)  # parses: not a log line on stdout
    nodes = {n["id"]: n for n in result["nodes"]}
    log_lines = [line for line in done.stderr.splitlines() if "switched off:" in line]
    for kind, hook in FAILING:
        node, name = nodes[_node(kind, hook)], _name(kind, hook)
        assert re.fullmatch(
            rf"{name} → {FALLBACK[kind]} after [\d,]+ evictions?", node["policies"][kind]
        ), node["policies"]
        (fallback,) = node["policy_fallbacks"]
        assert fallback["hook"] == hook and fallback["kind"] == kind
        assert fallback["error"] == "RuntimeError: bug in " + hook + "\\nsecond line"
        assert fallback["in_force"] == node["policies"][kind]
        # Said once, in one line naming the policy, the hook and the error.
        said = [line for line in log_lines if f"cache policy {name} ({kind})" in line]
        assert len(said) == 1, said
        assert f".{hook} raised RuntimeError: bug in {hook}" in said[0]
    assert len(log_lines) == len(FAILING)
    # --strict says why it failed, naming every switch.
    assert "--strict: a cache policy raised and was switched off (9 in all)" in done.stderr
    for kind, hook in FAILING:
        assert f"  {_node(kind, hook)}: {kind} policy {_name(kind, hook)} → " in done.stderr


def test_kvc_simulate_table_says_the_policy_in_force_and_exits_0_without_strict(
    tmp_path: Path, failing_env: dict[str, str]
) -> None:
    done = _simulate(tmp_path, failing_env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "cache policies switched off" in out
    for kind, hook in FAILING:
        assert re.search(
            rf"^  {_node(kind, hook)}: {kind} policy {_name(kind, hook)} → {FALLBACK[kind]} "
            rf"after [\d,]+ evictions? \(\w+\.{hook} raised RuntimeError: bug in {hook}"
            r"\\nsecond line\)$",
            out,
            re.M,
        ), out
    assert "switched off:" not in out  # the log line is on stderr only


def test_kvc_simulate_strict_passes_when_every_policy_holds(
    tmp_path: Path, failing_env: dict[str, str]
) -> None:
    done = _simulate(tmp_path, failing_env, "--json", "--strict", failing=False)
    assert done.returncode == 0, done.stderr
    (node,) = json.loads(done.stdout)["nodes"]
    assert node["policies"] == {"eviction": "lru", "admission": "threshold",
                                "retention": "request"}
    assert node["policy_fallbacks"] == [] and done.stderr == ""


def test_a_fleet_and_a_sweep_say_a_switch_too(tmp_path: Path, failing_env: dict[str, str]) -> None:
    fleet = _simulate(tmp_path, failing_env, "--json", "--strict", "--fleet", "2", "--router",
                      "round_robin")
    assert fleet.returncode == 1, fleet.stderr
    (run,) = json.loads(fleet.stdout)
    switched = {(f["node"], f["hook"]) for f in run["policy_fallbacks"]}
    assert switched == {(_node(k, h), h) for k, h in FAILING}
    assert "round_robin, engine " in fleet.stderr
    sweep = _simulate(tmp_path, failing_env, "--strict", "--sweep", "capacity=8KiB,16KiB",
                      "-o", str(tmp_path / "sweep.txt"))
    assert sweep.returncode == 1, sweep.stderr
    assert "capacity=16KiB: eviction_victims: eviction policy fail-victims → lru" in (
        tmp_path / "sweep.txt"
    ).read_text()


# -- the index, in process ---------------------------------------------------- #


class _Fails(Lru):
    """lru until ``hook`` is called after ``armed``."""

    armed = False

    def __init__(self, slots: int, hook: str) -> None:
        super().__init__(slots)
        self.hook = hook

    def _check(self, hook: str) -> None:
        if self.armed and hook == self.hook:
            raise ValueError(f"{hook} broke")

    def added(self, block: Any) -> None:
        self._check("added")
        super().added(block)

    def touched(self, block: Any) -> None:
        self._check("touched")
        super().touched(block)

    def victims(self) -> Any:
        self._check("victims")
        return super().victims()

    def removed(self, block: Any, evicted: bool) -> None:
        self._check("removed")
        super().removed(block, evicted)


@pytest.mark.parametrize("hook", ["added", "touched", "victims", "removed"])
def test_the_index_reports_the_eviction_policy_in_force_after_a_switch(hook: str) -> None:
    policy = _Fails(4, hook)
    index = BlockIndex(4, policy)
    entries = []
    for n in range(6):  # two evictions before it fails
        entry = index.allocate(bytes([n]))
        assert entry is not None
        index.mark_ready(entry)
        entries.append(entry)
    assert index.health.in_force() == {"eviction": "_Fails"}
    policy.armed = True
    with structlog.testing.capture_logs() as logs:
        index.touch(entries[-1])
        for n in range(6, 9):
            entry = index.allocate(bytes([n]))
            assert entry is not None
            index.mark_ready(entry)
    # (added raises after the third eviction: the block it made room for is ready)
    at = 3 if hook == "added" else 2
    assert index.health.in_force() == {"eviction": f"_Fails → lru after {at} evictions"}
    reason = index.health.fallbacks["eviction"].reason
    assert reason == f"_Fails.{hook} raised ValueError: {hook} broke"
    (said,) = [e for e in logs if e["log_level"] == "error"]  # once
    assert said["hook"] == hook and said["policy"] == "_Fails"
    assert said["error"] == f"ValueError: {hook} broke"
    assert type(index.policy) is Lru and len(index) == 4  # lru goes on


class _Keeps(RequestRetention):
    """``request`` until ``hook`` is called after ``armed``."""

    armed = False
    hook = ""

    def _check(self, hook: str) -> None:
        if self.armed and hook == self.hook:
            raise KeyError(hook)

    def requested(self, block: Any, retention: Retention, now: float) -> bool:
        self._check("requested")
        return super().requested(block, retention, now)

    def kept(self, block: Any, now: float) -> bool:
        self._check("kept")
        return super().kept(block, now)

    def yields(self, kept: Any, now: float) -> Any:
        self._check("yields")
        return super().yields(kept, now)

    def removed(self, block: Any) -> None:
        self._check("removed")
        super().removed(block)


@pytest.mark.parametrize("hook", ["requested", "kept", "yields", "removed"])
def test_the_index_reports_no_retention_in_force_after_a_switch(hook: str) -> None:
    policy = _Keeps(4)
    policy.hook = hook
    index = BlockIndex(4, "lru", retention=policy)
    for n in range(5):  # one eviction before it fails
        entry = index.allocate(bytes([n]))
        assert entry is not None
        index.mark_ready(entry)
        assert index.retain(entry, Retention(ttl_s=60))
    policy.armed = True
    with structlog.testing.capture_logs() as logs:
        for n in range(5, 8):  # every block kept: yields chooses
            entry = index.allocate(bytes([n]))
            assert entry is not None
            index.mark_ready(entry)
            index.retain(entry, Retention(ttl_s=60))
    # (requested is asked when the request ends: after the eviction that made room)
    at = "2 evictions" if hook == "requested" else "1 eviction"
    assert index.health.in_force() == {
        "eviction": "lru", "retention": f"_Keeps → no block kept after {at}"
    }
    assert index.health.fallbacks["retention"].reason.startswith(f"_Keeps.{hook} raised KeyError")
    (said,) = [e for e in logs if e["log_level"] == "error"]
    assert said["hook"] == hook and said["kind"] == "retention"
    assert index.retention is None and len(index) == 4
