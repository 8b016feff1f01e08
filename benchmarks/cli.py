"""How fast ``kvc validate`` is, in process and as a command, and ``kvc --help`` start-up.

Target: validating a 100-node pipeline in process well under 50 ms, so that
validation at every engine start and in editors' save hooks costs nothing
anyone notices. The command's wall time adds interpreter start-up, imports and
plugin discovery, printed separately so the two are not confused.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

IN_PROCESS_TARGET_MS = 50.0
NODES = 100


def pipeline_text(n: int = NODES) -> str:
    """A realistic n-node pipeline using only the builtin vllm plugin.

    Chains of ``needs``, explicit load order and save targets, and declared
    capabilities, so every graph check has work to do.
    """
    lines = ["version: 1", "load_policy: longest_hit", "nodes:"]
    for i in range(n):
        lines += [
            f"  n{i}:",
            "    plugin: vllm",
            "    on_error: recompute",
        ]
        if i % 10:
            lines.append(f"    needs: [n{i - 1}]")
        lines += [
            "    config:",
            f"      connector: Connector{i}",
            f"      kv_port: {5600 + i}",
            "      extra_config: {path: kv-store, chunk_size: 256}",
            f"      capabilities: {{async_save: true, transfer_params_keys: [key{i}]}}",
        ]
    order = ", ".join(f"n{i}" for i in range(n))
    lines += [f"load_order: [{order}]", f"save_to: [{order}]"]
    return "\n".join(lines) + "\n"


def _median_ms(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), min(times)


def _cpu_median_ms(fn: Callable[[], object], repeat: int) -> float:
    # CPU time of this process: what validation costs, whatever else the machine runs.
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1000)
    return statistics.median(times)


def _kvc() -> list[str]:
    script = Path(sys.executable).with_name("kvc")
    if script.exists():
        return [str(script)]
    found = shutil.which("kvc")
    return [found] if found else [sys.executable, "-m", "composer.cli"]


def main() -> int:
    import composer

    text = pipeline_text()
    registry = composer.discover()
    composer.validate_text(text, registry=registry)  # warm pydantic's validators

    def validate() -> object:
        return composer.validate_text(text, registry=registry)

    median, best = _median_ms(validate, 30)
    cpu = _cpu_median_ms(validate, 30)
    verdict = "ok" if median < IN_PROCESS_TARGET_MS else "SLOWER THAN TARGET"
    print(
        f"validate_text, {NODES} nodes, in process: median {median:.1f} ms, best {best:.1f} ms, "
        f"CPU {cpu:.1f} ms (target < {IN_PROCESS_TARGET_MS:.0f} ms: {verdict})"
    )
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"(load average {load:.1f} on {os.cpu_count()} CPUs: wall times are inflated)")
    median, best = _median_ms(composer.discover, 30)
    print(f"plugin discovery (entry points): median {median:.1f} ms, best {best:.1f} ms")

    kvc = _kvc()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(text)

        def kvc_validate() -> None:
            subprocess.run([*kvc, "validate", str(path)], check=True, capture_output=True)

        def help_() -> None:
            subprocess.run([*kvc, "--help"], check=True, capture_output=True)

        def python() -> None:
            subprocess.run([sys.executable, "-c", "pass"], check=True, capture_output=True)

        kvc_validate()  # warm the page cache
        for label, fn in (
            (f"`kvc validate` ({NODES} nodes), whole command", kvc_validate),
            ("`kvc --help`, whole command", help_),
            ("bare `python -c pass`, for scale", python),
        ):
            median, best = _median_ms(fn, 7)
            print(f"{label}: median {median:.0f} ms, best {best:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
