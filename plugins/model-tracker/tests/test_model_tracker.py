"""model-tracker: discovery, the typed handle, the summary, LMCache registration, ordering."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kvc_model_tracker import ModelHandle, ModelNotTracked, ModelTrackerConfig
from kvc_model_tracker.node import ModelTrackerNode, summarize

from composer import (
    PipelineInvalid,
    Plugin,
    PluginType,
    Registry,
    discover,
    hookimpl,
    load_pipeline,
)
from composer.testing.chains import NodeFailed, chain_for


class TinyLM(torch.nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(layers))
        self.to(torch.bfloat16)


class Consumer(Plugin):
    """A node that needs the tracker and reads the model in its own initialize hook."""

    seen: list[Any] = []

    @hookimpl
    def initialize_worker_connector(
        self, model: Any, vllm_config: Any, kv_cache_config: Any
    ) -> None:
        (handle,) = self.ctx.needs.values()
        Consumer.seen.append(handle.require())


CONSUMER = PluginType(name="consumer", node=Consumer, roles={"service"})


def registry() -> Registry:
    found = discover()
    return Registry({**found.types, "consumer": CONSUMER})


def test_registered_through_the_entry_point() -> None:
    ptype = discover()["model-tracker"]
    assert ptype.package == "kv-composer-model-tracker"
    # Inferred: a worker class only, and one role.
    assert ptype.processes == frozenset({"worker"})
    assert ptype.default_role == "service"
    assert ptype.resolve_capabilities(ModelTrackerConfig()).provides_model


def test_validation_imports_neither_torch_nor_lmcache() -> None:
    code = (
        "import sys; from composer import load_pipeline;"
        "load_pipeline({'version': 1, 'nodes': {'t': {'plugin': 'model-tracker'}}});"
        "print(sorted(m for m in ('torch', 'vllm', 'lmcache') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_config_errors_are_clear() -> None:
    with pytest.raises(PipelineInvalid) as err:
        load_pipeline(
            {
                "version": 1,
                "nodes": {
                    "t": {"plugin": "model-tracker", "config": {"lmcache": "yes", "report": 1}}
                },
            }
        )
    text = str(err.value)
    assert 'nodes.t.config.lmcache: "yes" is not allowed; expected one of "always", "auto"' in text
    assert 'unknown key "report"' in text and "report_file" in text


def test_role_other_than_service_is_refused() -> None:
    with pytest.raises(PipelineInvalid, match='cannot take role "load"'):
        load_pipeline({"version": 1, "nodes": {"t": {"plugin": "model-tracker", "role": "load"}}})


def test_summary_of_a_torch_model() -> None:
    s = summarize(TinyLM(layers=3))
    assert (s.model_class, s.layers, s.parameters, s.dtype) == ("TinyLM", 3, 3 * 20, "bfloat16")
    assert s.line() == "TinyLM: 3 layers, 60 parameters, dtype bfloat16"


def test_handle_require_without_a_model_is_a_clear_error() -> None:
    handle = ModelHandle("tracker")
    assert handle.model is None
    with pytest.raises(ModelNotTracked, match='model-tracker node "tracker" has no model'):
        handle.require()


def _pipeline(config: dict[str, Any] | None = None) -> Any:
    return load_pipeline(
        {
            "version": 1,
            "nodes": {
                "user": {"plugin": "consumer", "needs": ["tracker"]},
                "tracker": {"plugin": "model-tracker", "config": config or {}},
            },
        },
        registry=registry(),
    )


def test_dependents_get_the_model_in_their_own_initialize_hook(tmp_path: Path) -> None:
    """The chain creates and initialises the tracker first, though it is listed second."""
    Consumer.seen = []
    chain = chain_for(_pipeline({"lmcache": "never", "report_file": str(tmp_path / "r")}), "worker")
    assert list(chain.nodes) == ["tracker", "user"]
    model = TinyLM()
    chain.initialize_worker_connector(model, None, None)
    assert Consumer.seen == [model]
    tracker = chain.nodes["tracker"]
    assert isinstance(tracker, ModelTrackerNode) and tracker.service().model is model
    report = json.loads((tmp_path / "r.0").read_text())
    assert report["model_class"] == "TinyLM" and report["lmcache_instance_id"] is None
    assert chain.take_stats()["tracker"]["counters"]["gauges"] == {"model_tracked": 1}


def test_the_scheduler_has_no_tracker() -> None:
    chain = chain_for(_pipeline(), "scheduler")
    assert "tracker" not in chain.nodes
    assert chain.nodes["user"].ctx.needs == {}


def test_registers_with_lmcaches_model_tracker() -> None:
    import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
    from lmcache.v1.compute.models.utils import VLLMModelTracker

    Consumer.seen = []
    chain = chain_for(
        _pipeline({"lmcache": "always", "lmcache_instance_id": "kvc-test-1"}), "worker"
    )
    model = TinyLM()
    chain.initialize_worker_connector(model, None, None)
    assert VLLMModelTracker.get_model("kvc-test-1") is model
    assert chain.nodes["tracker"].service().lmcache_instance_id == "kvc-test-1"


def test_another_model_under_the_same_lmcache_id_is_an_error() -> None:
    import lmcache  # noqa: F401  (installed by `make test`: missing must fail, not skip)
    from lmcache.v1.compute.models.utils import VLLMModelTracker

    VLLMModelTracker.register_model("kvc-test-2", TinyLM())
    chain = chain_for(_pipeline({"lmcache_instance_id": "kvc-test-2"}), "worker")
    # Through the chain (on_error: fail), the engine stops with the node named.
    with pytest.raises(NodeFailed, match="already holds another model") as failed:
        chain.initialize_worker_connector(TinyLM(), None, None)
    assert isinstance(failed.value.__cause__, ModelNotTracked)


def test_lmcache_always_without_lmcache_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvc_model_tracker.node as node

    monkeypatch.setattr(node, "lmcache_available", lambda: False)
    chain = chain_for(_pipeline({"lmcache": "always"}), "worker")
    with pytest.raises(NodeFailed, match="LMCache is not installed") as failed:
        chain.initialize_worker_connector(TinyLM(), None, None)
    assert isinstance(failed.value.__cause__, ModelNotTracked)
    # auto: no registration and no LMCache import attempted.
    Consumer.seen = []
    chain = chain_for(_pipeline({"lmcache": "auto"}), "worker")
    chain.initialize_worker_connector(TinyLM(), None, None)
    assert chain.nodes["tracker"].service().lmcache_instance_id is None


def test_no_model_handed_over() -> None:
    Consumer.seen = []
    chain = chain_for(_pipeline(), "worker")
    with pytest.raises(NodeFailed) as failed:
        chain.initialize_worker_connector(None, None, None)
    assert isinstance(failed.value.__cause__, ModelNotTracked)
