"""vLLM's sleep mode through a pipeline, and connector members a later vLLM adds.

vLLM 0.33 added ``supports_sleep_mode`` (a gate asked of the connector class
before an engine starts), ``unregister_kv_caches`` and ``restore_kv_caches``
(called around sleep and wake-up). The composed connector answers the gate as
MultiConnector composes it (every node must; a ``vllm`` node's connector class
answers for it), and the two hooks reach every node once per sleep. Run under
each supported vLLM release (``make test``); on 0.32, which has neither the gate
nor the hooks, vLLM never asks, and the composed answer is still each node's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from composer import CanonicalKVCaches, Capabilities, Plugin, PluginType, hookimpl
from composer.pipeline import ResolvedPipeline
from composer.testing.chains import switched_off
from composer.testing.multiconnector import make_vllm_config
from composer.validation import load_pipeline
from composer.vllm.connector import ComposedConnector
from composer.vllm.pipeline_source import sleep_mode_refusals
from composer.vllm.registration import register
from composer.vllm.surface import UnknownGate, check_surface, unknown_members

HERE = Path(__file__).resolve().parent
VLLM_HAS_SLEEP_GATE = hasattr(KVConnectorBase_V1, "supports_sleep_mode")


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register()


# --------------------------------------------------------------------------- #
# Plugin nodes: test plugin types, found through KV_COMPOSER_PLUGIN_MODULES
# --------------------------------------------------------------------------- #

#: (node, hook) of every sleep-mode call the recording nodes get, in order.
HEARD: list[tuple[str, str]] = []


class Registers(Plugin):
    """Holds views of vLLM's KV caches, knows nothing of sleep mode."""

    @hookimpl
    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        self.views = [r.tensor for r in kv_caches.regions]


class RegistersAndUnregisters(Registers):
    @hookimpl
    def unregister_kv_caches(self) -> None:
        HEARD.append((self.node_id, "unregister_kv_caches"))
        self.views = []


class Sleeps(RegistersAndUnregisters):
    @hookimpl
    def restore_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        HEARD.append((self.node_id, "restore_kv_caches"))
        self.views = [r.tensor for r in kv_caches.regions]


class Counts(Plugin):
    """Touches no KV cache (a request counter)."""

    @hookimpl
    def on_new_request(self) -> None:
        pass


#: plugin name -> (worker class, declared sleep_mode, scheduler only?)
KINDS: dict[str, tuple[type, bool | None, bool]] = {
    "t-counts": (Counts, None, False),
    "t-counts-scheduler": (Counts, None, True),
    "t-registers": (Registers, None, False),
    "t-registers-unregisters": (RegistersAndUnregisters, None, False),
    "t-sleeps": (Sleeps, None, False),
    "t-sleeps-declared-no": (Sleeps, False, False),
    "t-registers-declared-yes": (Registers, True, False),
}


@hookimpl
def register_plugin_types(register: Callable[[PluginType], None]) -> None:
    for name, (cls, declared, scheduler_only) in KINDS.items():
        register(
            PluginType(
                name=name,
                **({"scheduler": cls} if scheduler_only else {"node": cls}),
                capabilities=Capabilities(hma=True, sleep_mode=declared),
            )
        )


@pytest.fixture(autouse=True)
def _test_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KV_COMPOSER_PLUGIN_MODULES", __name__.rpartition(".")[2])
    HEARD.clear()
    yield


def pipeline(**nodes: dict[str, Any]) -> ResolvedPipeline:
    return load_pipeline({"version": 1, "nodes": nodes})


CAN_SLEEP = {
    "t-counts": True,
    "t-counts-scheduler": True,
    "t-registers": False,
    "t-registers-unregisters": False,
    "t-sleeps": True,
    "t-sleeps-declared-no": False,
    "t-registers-declared-yes": True,
}


@pytest.mark.parametrize("plugin", sorted(KINDS))
def test_a_plugin_node_sleeps_when_it_holds_no_view_or_gives_it_back(plugin: str) -> None:
    assert set(CAN_SLEEP) == set(KINDS)
    refusals = sleep_mode_refusals(pipeline(n={"plugin": plugin}))
    assert (not refusals) == CAN_SLEEP[plugin]
    if refusals:
        ((node, why),) = refusals
        assert node.id == "n"
        assert plugin in why
        if KINDS[plugin][1] is None:  # judged from the class: the missing hooks named
            missing = "unregister_kv_caches / restore_kv_caches"
            if plugin == "t-registers-unregisters":
                missing = "restore_kv_caches"
            assert f"implements no {missing}" in why


def test_the_first_party_tiers_can_sleep() -> None:
    found = sleep_mode_refusals(
        pipeline(
            cpu={"plugin": "offload-cpu", "config": {"capacity": "64MiB"}},
            tracker={"plugin": "model-tracker"},
            lmcache={"plugin": "lmcache", "config": {"mode": "server"}},
            lmcache_in_process={"plugin": "lmcache", "config": {"mode": "in_process"}},
        )
    )
    assert found == []


# --------------------------------------------------------------------------- #
# vllm nodes: the connector class answers, as under MultiConnector
# --------------------------------------------------------------------------- #


class RefusesSleep(KVConnectorBase_V1):
    """An out-of-tree connector that refuses sleep mode (found by module path)."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return False


def native(connector: str, **extra: Any) -> dict[str, Any]:
    node: dict[str, Any] = {"plugin": "vllm", "role": "both", "config": {"connector": connector}}
    if connector == "RefusesSleep":
        node["config"]["module_path"] = __name__
    if extra:
        node["config"]["extra_config"] = extra
    return node


NATIVES: list[tuple[str, dict[str, Any]]] = [
    # (A classmethod question: the path is never created.)
    ("ExampleConnector", {"shared_storage_path": "kvc-sleep-store"}),
    ("NixlConnector", {}),
    ("NixlConnector", {"backends": ["UCX"]}),
    ("NixlConnector", {"backends": ["LIBFABRIC"]}),
    ("NixlConnector", {"backends": ["UCX", "LIBFABRIC"]}),
    ("RefusesSleep", {}),
]
NATIVES += [
    (name, {})
    for name in ("NixlPushConnector", "NixlPullConnector", "MooncakeConnector")
    if name in KVConnectorFactory._registry
]


def multiconnector_answer(children: list[dict[str, Any]]) -> bool:
    """What vLLM's own MultiConnector says for the same children; on a vLLM without
    the gate (0.32) nothing is asked, so nothing is refused."""
    if not VLLM_HAS_SLEEP_GATE:
        return True
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": children},
    )
    return bool(MultiConnector.supports_sleep_mode(config))  # type: ignore[attr-defined]


def child(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"kv_connector": name, "kv_role": "kv_both"}
    if name == "RefusesSleep":
        out["kv_connector_module_path"] = __name__
    if extra:
        out["kv_connector_extra_config"] = extra
    return out


def composed_config(nodes: dict[str, dict[str, Any]]) -> KVTransferConfig:
    spec = {"version": 1, "nodes": nodes}
    return KVTransferConfig(
        kv_connector="ComposedConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"pipeline": json.loads(json.dumps(spec))},
    )


@pytest.mark.parametrize(("name", "extra"), NATIVES, ids=lambda v: str(v))
def test_a_vllm_node_answers_as_its_connector_class_does_under_multiconnector(
    name: str, extra: dict[str, Any]
) -> None:
    expected = multiconnector_answer([child(name, extra)])
    if name == "RefusesSleep":
        expected = False  # its own classmethod, on any vLLM
    alone = composed_config({"x": native(name, **extra)})
    assert ComposedConnector.supports_sleep_mode(alone) == expected
    # Beside a tier that can sleep, the pipeline can sleep when the connector can.
    beside = composed_config(
        {"cpu": {"plugin": "t-sleeps"}, "x": native(name, **extra)},
    )
    assert ComposedConnector.supports_sleep_mode(beside) == expected


def test_a_refusal_names_the_node_and_why() -> None:
    config = composed_config(
        {
            "cpu": {"plugin": "t-registers"},
            "ok": {"plugin": "t-sleeps"},
            "transport": native("RefusesSleep"),
        }
    )
    with structlog.testing.capture_logs() as logs:
        assert ComposedConnector.supports_sleep_mode(config) is False
    said = {e["node"]: e["why"] for e in logs if e["event"] == "this pipeline cannot sleep"}
    assert set(said) == {"cpu", "transport"}
    assert "RefusesSleep.supports_sleep_mode says no" in said["transport"]
    assert "implements no unregister_kv_caches / restore_kv_caches" in said["cpu"]


# --------------------------------------------------------------------------- #
# unregister / restore through a running worker-side connector
# --------------------------------------------------------------------------- #

BLOCKS, BS, HEADS, HEAD = 8, 16, 2, 8
SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)


def kv_caches() -> tuple[dict[str, torch.Tensor], KVCacheConfig]:
    page = SPEC.page_size_bytes
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    storage = torch.zeros(len(layers) * BLOCKS * page, dtype=torch.int8)
    flat = storage.view(torch.float32)
    kv = {
        name: flat[i * BLOCKS * page // 4 : (i + 1) * BLOCKS * page // 4].view(
            BLOCKS, HEADS, BS, 2 * HEAD
        )
        for i, name in enumerate(layers)
    }
    tensor = KVCacheTensor(
        size=storage.numel(), layers=layers, layer_stride=BLOCKS * page, block_stride=page
    )
    groups = [KVCacheGroupSpec(layers, SPEC)]
    return kv, KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=groups)


def worker_connector(nodes: dict[str, dict[str, Any]]) -> ComposedConnector:
    kv, kv_cache_config = kv_caches()
    vllm_config = make_vllm_config(None)
    vllm_config.kv_transfer_config = composed_config(nodes)
    connector = ComposedConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches(kv)
    return connector


def test_each_sleep_reaches_every_node_once_with_the_caches_again() -> None:
    connector = worker_connector(
        {"a": {"plugin": "t-sleeps"}, "quiet": {"plugin": "t-counts"}, "b": {"plugin": "t-sleeps"}}
    )
    nodes = connector.chain.nodes
    before = [t.data_ptr() for t in nodes["a"].views]
    connector.restore_kv_caches()  # awake: nothing to restore
    assert HEARD == []
    connector.unregister_kv_caches()
    connector.unregister_kv_caches()  # a discard while asleep: the nodes heard it already
    assert HEARD == [("a", "unregister_kv_caches"), ("b", "unregister_kv_caches")]
    assert nodes["a"].views == [] and nodes["b"].views == []
    connector.restore_kv_caches()
    connector.restore_kv_caches()
    assert HEARD[2:] == [("a", "restore_kv_caches"), ("b", "restore_kv_caches")]
    assert [t.data_ptr() for t in nodes["a"].views] == before
    connector.unregister_kv_caches()  # the next sleep is heard again
    assert HEARD[4:] == [("a", "unregister_kv_caches"), ("b", "unregister_kv_caches")]


def test_a_node_failing_to_let_go_is_switched_off_under_recompute() -> None:
    class Fails(Sleeps):
        @hookimpl
        def unregister_kv_caches(self) -> None:
            raise RuntimeError("cannot deregister")

    KINDS["t-fails"] = (Fails, None, False)
    try:
        connector = worker_connector(
            {"bad": {"plugin": "t-fails", "on_error": "recompute"}, "good": {"plugin": "t-sleeps"}}
        )
        connector.unregister_kv_caches()
        assert switched_off(connector.get_kv_connector_stats()) == {"bad"}
        connector.restore_kv_caches()
        assert HEARD == [("good", "unregister_kv_caches"), ("good", "restore_kv_caches")]
    finally:
        del KINDS["t-fails"]


# --------------------------------------------------------------------------- #
# A later vLLM: members the composed connector does not know
# --------------------------------------------------------------------------- #


def _method(self: Any) -> None:
    return None


def _gate(cls: Any, *args: Any) -> bool:
    return True


FUTURE_MEMBERS: dict[str, Callable[[], Any]] = {
    "method": lambda: _method,
    "classmethod": lambda: classmethod(_gate),
    "property": lambda: property(lambda self: True),
}


@pytest.mark.parametrize("kind", sorted(FUTURE_MEMBERS))
@pytest.mark.parametrize("name", ["supports_teleport", "requires_kv_fence"])
def test_an_unknown_gate_refuses_the_engine_by_name(
    monkeypatch: pytest.MonkeyPatch, kind: str, name: str
) -> None:
    monkeypatch.setattr(KVConnectorBase_V1, name, FUTURE_MEMBERS[kind](), raising=False)
    with pytest.raises(UnknownGate, match=name):
        worker_connector({"a": {"plugin": "t-sleeps"}})


@pytest.mark.parametrize("kind", sorted(FUTURE_MEMBERS))
def test_an_unknown_member_is_named_once_with_what_the_chain_does(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setattr(KVConnectorBase_V1, "offload_hint", FUTURE_MEMBERS[kind](), raising=False)
    monkeypatch.setattr(KVConnectorBase_V1, "compact_kv", _method, raising=False)
    with structlog.testing.capture_logs() as logs:
        worker_connector({"a": {"plugin": "t-sleeps"}})
    warned = [e for e in logs if e["log_level"] == "warning" and "members" in e]
    assert len(warned) == 1
    members = warned[0]["members"]
    assert [m.split(" ")[0] for m in members] == ["compact_kv", "offload_hint"]
    assert all("vLLM's default of KVConnectorBase_V1, no node is asked" in m for m in members)


def test_the_installed_vllm_has_no_unknown_member() -> None:
    assert unknown_members(ComposedConnector, KVConnectorBase_V1) == []
    with structlog.testing.capture_logs() as logs:
        assert check_surface(ComposedConnector, KVConnectorBase_V1, structlog.get_logger()) == []
    assert logs == []


# --------------------------------------------------------------------------- #
# kvc serve --enable-sleep-mode: refused before launch, located
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("args", "asked"),
    [
        (["MODEL"], False),
        (["MODEL", "--enable-sleep-mode"], True),
        (["MODEL", "--enable_sleep_mode"], True),
        (["MODEL", "--enable-sleep-mode=true"], True),
        (["MODEL", "--enable-sleep-mode=false"], False),
        (["MODEL", "--enable-sleep-mode", "--no-enable-sleep-mode"], False),
        (["MODEL", "--no-enable-sleep-mode", "--enable-sleep-mode"], True),
    ],
)
def test_the_sleep_mode_flag_is_read_as_vllm_reads_it(args: list[str], asked: bool) -> None:
    from composer.cli.serve import sleep_mode_asked

    assert sleep_mode_asked(args) is asked


SLEEPLESS = """\
version: 1
nodes:
  cpu:
    plugin: t-sleeps
  mirror:
    plugin: t-registers
  transport:
    plugin: vllm
    config:
      connector: RefusesSleep
      module_path: {module}
"""


def test_serve_refuses_a_pipeline_that_cannot_sleep_naming_each_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from composer.cli import serve as serve_module

    file = tmp_path / "sleepless.yaml"
    file.write_text(SLEEPLESS.format(module=__name__.rpartition(".")[2]))
    launched: list[list[str]] = []
    monkeypatch.setattr(serve_module.os, "execv", lambda path, argv: launched.append(argv))
    assert serve_module.serve(str(file), ["MODEL", "--enable-sleep-mode"]) == 2
    err = capsys.readouterr().err
    assert launched == [] and "Traceback" not in err
    assert f"{file}:6:13: nodes.mirror.plugin: node \"mirror\" cannot follow" in err
    assert "implements no unregister_kv_caches / restore_kv_caches" in err
    assert f"{file}:8:13: nodes.transport.plugin:" in err
    assert "RefusesSleep.supports_sleep_mode says no" in err
    assert "cpu" not in err.replace(str(file), "")
    # Without sleep mode the same pipeline launches.
    serve_module.serve(str(file), ["MODEL"])
    assert len(launched) == 1


def test_validate_says_the_same_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from composer.cli import main

    file = tmp_path / "sleepless.yaml"
    file.write_text(SLEEPLESS.format(module=__name__.rpartition(".")[2]))
    assert main(["validate", str(file)]) == 0  # sleep mode not asked for
    capsys.readouterr()
    assert main(["validate", "--enable-sleep-mode", str(file)]) == 2
    out = capsys.readouterr().out
    assert f"{file}:6:13: nodes.mirror.plugin:" in out
    assert f"{file}:8:13: nodes.transport.plugin:" in out
    sleeps = tmp_path / "sleeps.yaml"
    sleeps.write_text("version: 1\nnodes:\n  cpu: {plugin: t-sleeps}\n")
    assert main(["validate", "--enable-sleep-mode", str(sleeps)]) == 0
