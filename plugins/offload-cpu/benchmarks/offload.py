"""Save+load throughput of the offload-cpu data path vs plain torch ops.

See :mod:`kvc_offload_cpu.throughput`; ``make bench`` runs :func:`main`.
"""

from __future__ import annotations

from kvc_offload_cpu.throughput import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    raise SystemExit(main())
