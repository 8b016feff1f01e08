"""Every hostile file in ``tests/hostile/``: exit 2, located, bounded, nothing forged.

Each file is validated by ``kvc validate`` in its own process under RLIMIT_AS =
512 MiB, two at a time (forked from one interpreter that imported KV Composer
once: :mod:`hostile_forks`). The 2 s budget is CPU time (user + system)
of the process: the machine running the tests is shared, and wall-clock time
there measures the neighbours; a hang is still caught, by a kill at 10 s of
wall-clock time. A crash, hang, memory blow-up or traceback shows up as a
wrong exit code, a kill or a line that is not ``file:line:col: ...``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

HOSTILE = Path(__file__).resolve().parent / "hostile"
ROOT = HOSTILE.parent.parent
MEMORY_LIMIT = 512 * 1024 * 1024
CPU_LIMIT_S = 2.0
HANG_LIMIT_S = 10.0
WORKERS = 2
# What must never reach a terminal raw: controls but newline, bidi and format characters.
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2066-\u2069]")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hostile_generate", HOSTILE / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CORPUS: dict[str, bytes] = _generator().corpus()


@dataclass
class Run:
    code: int | None  # None: killed at HANG_LIMIT_S
    out: str
    err: str
    seconds: float  # wall clock
    cpu_seconds: float
    max_rss_kib: int


def _run_all(kvc: str, names: list[str], outputs: Path) -> dict[str, Run]:
    """``kvc validate`` on each file, ``WORKERS`` at a time, each in its own process
    under the limits (:mod:`hostile_forks` forks them from one interpreter)."""
    python = str(Path(kvc).parent / "python")
    runner = Path(__file__).with_name("hostile_forks.py")
    command = [python, str(runner), str(outputs), str(MEMORY_LIMIT), str(HANG_LIMIT_S)]
    # Every file could hang: the whole run is bounded as the files are.
    budget = HANG_LIMIT_S * len(names) / WORKERS + 60
    subprocess.run(
        [*command, str(WORKERS), *names], cwd=ROOT, check=True, timeout=budget,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    measured = json.loads((outputs / "results.json").read_text())
    results: dict[str, Run] = {}
    for name in names:
        code, elapsed, cpu = measured[name]
        texts = [
            (outputs / f"{name}.{kind}").read_bytes().decode("utf-8", "replace")
            for kind in ("out", "err")
        ]
        rss_file = outputs / f"{name}.rss"
        rss = int(rss_file.read_text()) if rss_file.exists() else MEMORY_LIMIT // 1024
        results[name] = Run(code, texts[0], texts[1], elapsed, cpu, rss)
    return results


@pytest.fixture(scope="module")
def runs(kvc: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    results = _run_all(kvc, sorted(CORPUS), tmp_path_factory.mktemp("hostile"))
    cpu = max(results.items(), key=lambda kv: kv[1].cpu_seconds)
    wall = max(results.items(), key=lambda kv: kv[1].seconds)
    rss = max(results.items(), key=lambda kv: kv[1].max_rss_kib)
    print(
        f"\nhostile corpus: {len(results)} files; most CPU {cpu[0]} {cpu[1].cpu_seconds:.2f} s; "
        f"longest {wall[0]} {wall[1].seconds:.2f} s; most memory {rss[0]} "
        f"{rss[1].max_rss_kib / 1024:.0f} MiB",
        file=sys.stderr,
    )
    return results


def test_the_corpus_on_disk_is_what_the_generator_writes() -> None:
    on_disk = {p.name: p.read_bytes() for p in HOSTILE.glob("*.yaml")}
    assert sorted(on_disk) == sorted(CORPUS), "run: python tests/hostile/generate.py"
    stale = [name for name, data in CORPUS.items() if on_disk[name] != data]
    assert not stale, f"out of date (run: python tests/hostile/generate.py): {stale}"


def test_the_corpus_covers_every_class() -> None:
    classes = {name.split("-", 1)[0] for name in CORPUS}
    assert classes == {
        "alias", "depth", "tag", "number", "encoding", "env", "strict", "forge", "graph",
        "yaml", "shape",
    }
    assert len(CORPUS) >= 200


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_hostile_file_is_rejected_with_a_location(name: str, runs: dict[str, Run]) -> None:
    run = runs[name]
    shown = f"exit {run.code}\nstdout:\n{run.out[:2000]}\nstderr:\n{run.err[:2000]}"
    assert run.code is not None, f"killed after {HANG_LIMIT_S} s\n{shown}"
    assert run.code == 2, shown
    assert "Traceback" not in run.out + run.err, shown
    lines = run.out.splitlines()
    summary = re.fullmatch(r"(\d+) problems? in 1 file\n", run.err)
    assert summary, shown
    # One line per problem: a name or key with a newline must not add a line.
    assert len(lines) == int(summary.group(1)), shown
    located = re.compile(rf"^tests/hostile/{re.escape(name)}:\d+:\d+: \S.*: .+$")
    for line in lines:
        assert located.match(line), line
    assert not UNSAFE.search(run.out + run.err), shown
    assert run.cpu_seconds < CPU_LIMIT_S, f"{run.cpu_seconds:.2f} s of CPU"
    assert run.max_rss_kib * 1024 < MEMORY_LIMIT
