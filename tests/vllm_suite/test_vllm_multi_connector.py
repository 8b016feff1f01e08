"""vLLM's own ``tests/v1/kv_connector/unit/test_multi_connector.py``, run against
ComposedConnector (see :mod:`multi_connector_adapter` for what is adapted).

The file is the running vLLM release's, from its sdist on PyPI (fetched with
pip on first use and kept in the virtualenv); a failed download fails this
module. Its tests run here under their own names; the ones listed in
``NOT_APPLICABLE`` (a GPU or a Hugging Face download) do not, for the reason
given there.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest
from multi_connector_adapter import NOT_APPLICABLE, both_sides_for, collected, load, vllm_test_names

_vllm = load()
globals().update(collected(_vllm))
# vLLM's conftest for these tests: the CPU attention backend accepts their block size.
# The underscore name is vLLM's (a fixture of its test suite), imported as its tests do.
from tests.v1.kv_connector.unit.conftest import _mock_cpu_backend_block_sizes  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _own_temp_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # vLLM's recording connector logs to files in the temp dir: keep each test's
    # apart from other runs on the same machine. (Not pytest's tmp_path: vLLM's
    # test parses "connector_" out of the file paths, and tmp_path has the test's
    # name in it.)
    folder = tempfile.mkdtemp(prefix="kvc-vllm-suite-")
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's tests call both processes' methods on one connector (see the adapter).
    monkeypatch.setattr("composer.vllm.connector.chain_for", both_sides_for)


def test_every_vllm_test_runs_here_or_says_why_not() -> None:
    names = vllm_test_names(_vllm)
    assert set(NOT_APPLICABLE) <= names, "a not-applicable test is gone from vLLM's file"
    here = {n for n in globals() if n in names}
    assert here == names - set(NOT_APPLICABLE)
