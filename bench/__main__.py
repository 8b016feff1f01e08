"""Run every ``bench/bench_*.py`` module's ``main()``, in file-name order.

``python -m bench`` runs them all; ``python -m bench cli dispatch`` runs the named ones.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path


def modules() -> list[str]:
    return sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))


def main(argv: list[str] | None = None) -> int:
    wanted = argv if argv is not None else sys.argv[1:]
    names = modules()
    if wanted:
        unknown = [w for w in wanted if f"bench_{w}" not in names and w not in names]
        if unknown:
            print(f"unknown benchmark(s) {unknown}; available: {names}", file=sys.stderr)
            return 2
        names = [n for n in names if n in wanted or n.removeprefix("bench_") in wanted]
    for name in names:
        print(f"== {name} ==", flush=True)
        start = time.perf_counter()
        module = importlib.import_module(f"bench.{name}")
        code = module.main()
        print(f"({name}: {time.perf_counter() - start:.1f} s)\n", flush=True)
        if code:
            print(f"{name} failed with exit code {code}", file=sys.stderr)
            return int(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
