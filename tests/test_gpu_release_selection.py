"""The choice of tests for the pass on vLLM's GPU release (tests/gpu_release/)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu_release"))

from selection import EVERY_TEST, VLLM, all_test_modules, chosen, engine_module  # noqa: E402

CHOSEN = chosen()


def _tests(relative: str) -> dict[str, list[str]]:
    return CHOSEN.get(ROOT / relative, {})


def test_every_way_ends_in_an_import_of_vllm_through_real_files() -> None:
    assert CHOSEN
    for tests in CHOSEN.values():
        for way in tests.values():
            *files, last = way
            assert last.split(".")[0] == "vllm" or last.startswith(VLLM[1]), way
            assert files and all((ROOT / f).is_file() for f in files), way


def test_vllm_own_tests_run_whole_modules() -> None:
    # Their tests are vLLM's, added to the module when it runs: only the module
    # level shows that it reaches vLLM.
    for name in ("test_vllm_multi_connector.py", "test_vllm_hma_auto_config.py"):
        assert EVERY_TEST in _tests(f"tests/vllm_suite/{name}")
    assert EVERY_TEST in _tests("tests/test_connector_surface.py")


def test_a_test_reaching_vllm_through_its_own_imports_only_is_chosen_alone() -> None:
    # The dispatch benchmark imports the connector inside benchmarks.dispatch's
    # functions; the module's other tests never import it.
    assert set(_tests("tests/test_bench.py")) == {
        "test_dispatch_benchmark_runs_every_configuration"
    }


def test_kvc_validate_deep_in_a_subprocess_is_chosen() -> None:
    assert "test_validate_deep_against_the_installed_vllm" in _tests("tests/test_cli.py")


def test_modules_that_never_reach_vllm_are_left_out() -> None:
    assert ROOT / "tests" / "test_errors_schema.py" in all_test_modules()
    assert ROOT / "tests" / "test_errors_schema.py" not in CHOSEN
    assert ROOT / "tests" / "test_gpu_release_selection.py" not in CHOSEN


def test_engine_modules_are_known_by_their_marker() -> None:
    assert engine_module(ROOT / "tests" / "e2e" / "test_adapter_e2e.py")
    assert not engine_module(ROOT / "tests" / "test_connector_surface.py")
    # test_plugin_api.py marks single tests e2e, not the module.
    assert not engine_module(ROOT / "tests" / "test_plugin_api.py")
