"""Run every ``benchmarks/*.py`` and ``plugins/*/benchmarks/*.py`` module's ``main()``.

``python -m benchmarks`` runs them all (the core's first, in file-name order);
``python -m benchmarks cli dispatch offload`` runs the named ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
#: What the benchmarks load into vLLM, not benchmarks themselves.
SUPPORT = {"__init__", "__main__", "dispatch_nodes", "noop_connector"}
PLUGIN_BENCHES = {p.stem: p for p in sorted(HERE.parent.glob("plugins/*/benchmarks/*.py"))}


def modules() -> list[str]:
    core = sorted(p.stem for p in HERE.glob("*.py") if p.stem not in SUPPORT)
    return core + list(PLUGIN_BENCHES)


def load(name: str) -> object:
    if name not in PLUGIN_BENCHES:
        return importlib.import_module(f"benchmarks.{name}")
    # A plugin's benchmark is a script beside its package, not an importable module.
    spec = importlib.util.spec_from_file_location(name, PLUGIN_BENCHES[name])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    wanted = argv if argv is not None else sys.argv[1:]
    names = modules()
    if wanted:
        unknown = [w for w in wanted if w not in names]
        if unknown:
            print(f"unknown benchmark(s) {unknown}; available: {names}", file=sys.stderr)
            return 2
        names = [n for n in names if n in wanted]
    for name in names:
        print(f"== {name} ==", flush=True)
        start = time.perf_counter()
        code = load(name).main()  # type: ignore[attr-defined]
        print(f"({name}: {time.perf_counter() - start:.1f} s)\n", flush=True)
        if code:
            print(f"{name} failed with exit code {code}", file=sys.stderr)
            return int(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
