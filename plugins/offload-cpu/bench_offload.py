"""Save+load throughput of the offload-cpu data path vs plain torch ops (see kvc_offload_cpu.bench)."""

from __future__ import annotations

from kvc_offload_cpu.bench import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
