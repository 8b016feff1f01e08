"""`make bench` keeps working: every benchmark loads, and the dispatch one runs.

Nothing here looks at a timing (the machines are noisy); the numbers are for
`make bench` to print. The engine benchmarks (time to first token, offload,
LMCache) take minutes and run real engines, so only their loading is checked.
"""

from __future__ import annotations

import os

import pytest

from bench import __main__ as bench_main


@pytest.mark.parametrize("name", bench_main.modules())
def test_every_benchmark_loads_and_has_main(name: str) -> None:
    module = bench_main.load(name)
    assert callable(module.main)  # type: ignore[attr-defined]


def test_unknown_benchmark_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main.main(["nope"]) == 2
    assert "available:" in capsys.readouterr().err


def test_dispatch_benchmark_runs_every_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import bench_dispatch

    # The benchmark adds its plugin module to the environment: undone after the test.
    monkeypatch.setenv(
        "KV_COMPOSER_PLUGIN_MODULES", os.environ.get("KV_COMPOSER_PLUGIN_MODULES", "")
    )

    report = bench_dispatch.run(rounds=3)
    for children in ("NoopConnector", "NoopFullConnector"):
        assert set(report[children]) == {
            f"{side}{n}" for side in ("multi", "comp") for n in (1, 3, 8)
        }
    assert set(report["plugins"]) == {
        "saver",
        "saver+7empty",
        "native",
        "native+7empty",
        "8empty",
        "direct",
    }
    for configs in report.values():
        for kinds in configs.values():
            assert set(kinds) == {"layer", "worker step", "sched step"}
            assert all(seconds > 0 for seconds in kinds.values())
