"""`make bench` keeps working: every benchmark loads, and the dispatch one runs.

Nothing here looks at a timing (the machines are noisy); the numbers are for
`make bench` to print. The engine benchmarks (time to first token, offload,
LMCache) take minutes and run real engines, so only their loading is checked.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from benchmarks import __main__ as bench_main


@pytest.mark.parametrize("name", bench_main.modules())
def test_every_benchmark_loads_and_has_main(name: str) -> None:
    module = bench_main.load(name)
    assert callable(module.main)  # type: ignore[attr-defined]


def test_unknown_benchmark_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main.main(["nope"]) == 2
    assert "available:" in capsys.readouterr().err


def test_dispatch_benchmark_runs_every_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import dispatch as bench_dispatch

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


def test_hybrid_benchmark_reads_the_engine_log_without_an_engine() -> None:
    from composer.testing.tiny_model import GEMMA3_1B_SHAPE, TinyModelSpec

    hybrid = bench_main.load("hybrid")
    # Gemma-3-1B: 26 layers x K and V x 1 KV head x 256 x bf16.
    assert hybrid.full_attention_bytes_per_token(GEMMA3_1B_SHAPE) == 26 * 2 * 256 * 2  # type: ignore[attr-defined]
    assert GEMMA3_1B_SHAPE.layer_types.count("full_attention") == 4
    six = hybrid.shape(6)  # type: ignore[attr-defined]
    assert six.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert six.head_dim == 256 and six.sliding_window == 512
    # head_dim joined the spec later: specs without it keep their cache folder.
    assert TinyModelSpec().key() == "04333554f9aa"
    log = (
        "INFO [kv_cache_utils.py:1] GPU KV cache size: 1,234 tokens, Maximum concurrency\n"
        "INFO [loggers.py:1] KV Transfer metrics: cpu.lookups=1, cpu.bytes_saved=1024\n"
        "DEBUG [loggers.py:1] KV Transfer metrics: cpu.bytes_saved=2048, cpu.tokens_saved=64\n"
        "INFO [loggers.py:1] KV Transfer metrics: other_cpu.bytes_saved=4096\n"
    )
    assert hybrid.kv_capacity(log) == 1234  # type: ignore[attr-defined]
    assert hybrid.saved_bytes(log) == 3072  # type: ignore[attr-defined]


def test_offload_benchmark_runs_and_reports_ratios() -> None:
    offload: Any = bench_main.load("offload")
    r = offload.run(num_blocks=64, bytes_per_block=4096, batch=16, reps=2)
    for key in ("ratio_vs_plain", "ratio_vs_plain_wide", "ratio_checksums_vs_plain"):
        assert r[key] > 0
    assert offload.main(["--blocks", "64", "--block-kib", "4", "--batch", "16", "--reps", "2"]) == 0
