"""vLLM's own ``tests/v1/kv_connector/unit/test_hma_auto_config.py``, run against
ComposedConnector (see :mod:`hma_auto_config_adapter` for what is adapted).

The file is the running vLLM release's, from its sdist on PyPI (fetched with
pip on first use and kept in the virtualenv); a failed download fails this
module. Its tests run here under their own names.
"""

from __future__ import annotations

from hma_auto_config_adapter import NOT_APPLICABLE, load
from multi_connector_adapter import collected, vllm_test_names

_vllm = load()
globals().update(collected(_vllm, NOT_APPLICABLE))


def test_every_vllm_test_runs_here_or_says_why_not() -> None:
    names = vllm_test_names(_vllm)
    assert set(NOT_APPLICABLE) <= names, "a not-applicable test is gone from vLLM's file"
    here = {n for n in globals() if n in names}
    assert here == names - set(NOT_APPLICABLE)


def test_the_translated_configurations_are_composed() -> None:
    # The adaptation is what makes these vLLM tests about ComposedConnector:
    # both MultiConnector cases of the file reach vLLM as pipelines.
    (params,) = [m for m in _vllm.test_hma_auto_config.pytestmark if m.name == "parametrize"]
    ids = params.kwargs["ids"]
    connectors = {i: c.kv_connector for i, (c, _) in zip(ids, params.args[1], strict=True)}
    assert connectors == {
        "hma_connector": "SimpleCPUOffloadConnector",
        "non_hma_connector": "ExampleConnector",
        "multi_all_hma": "ComposedConnector",
        "multi_mixed": "ComposedConnector",
    }
