"""The memory a node may still have allocated: the machine's, bounded by its container's."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from composer import memory as memory_module

GiB = 2**30


def _limits(tmp_path: Path, v2: str | None, v1: str | None) -> tuple[Path, Path]:
    paths = (tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes")
    for path, text in zip(paths, (v2, v1), strict=True):
        if text is not None:
            path.write_text(text + "\n")
    return paths


@pytest.mark.parametrize(
    ("v2", "v1", "limit"),
    [
        (None, None, None),  # no cgroup memory controller
        ("max", None, None),  # cgroup v2, no limit
        (str(GiB), None, GiB),  # cgroup v2 container
        (None, str(2 * GiB), 2 * GiB),  # cgroup v1 container
        (None, str(2**63 - 4096), 2**63 - 4096),  # cgroup v1 root: "no limit" as a number
        (str(GiB), str(2 * GiB), GiB),  # v2 is asked first
    ],
)
def test_a_containers_memory_limit_bounds_the_memory(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    v2: str | None,
    v1: str | None,
    limit: int | None,
) -> None:
    monkeypatch.setattr(memory_module, "CGROUP_LIMITS", _limits(tmp_path, v2, v1))
    assert memory_module._container_limit() == limit
    machine = psutil.virtual_memory()
    available, total = memory_module.available_memory()
    assert total == min(machine.total, limit or machine.total)
    # Free memory moves between the two reads: what matters is that neither passes the limit.
    assert available <= total
