"""Every file in examples/ is exercised here; a file no test covers fails the suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from composer import discover, kv_transfer_config, load_pipeline
from composer.discovery import ALLOW_ENV, DENY_ENV

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODELINE = "# yaml-language-server: $schema=../schemas/pipeline.schema.json"

#: What each YAML example claims about itself: (nodes in dependency order, runs as).
YAML_EXAMPLES = {
    "native-multiconnector.yaml": (["nixl", "storage"], "MultiConnector"),
    "cpu-offload.yaml": (["cpu"], "ComposedConnector"),
    "offload-before-nixl.yaml": (["cpu", "nixl"], "ComposedConnector"),
}
PY_EXAMPLES = {"compose.py"}


@pytest.fixture(autouse=True)
def all_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.delenv(DENY_ENV, raising=False)


def test_every_example_is_covered() -> None:
    present = {p.name for p in EXAMPLES.iterdir() if not p.name.startswith((".", "__"))}
    covered = set(YAML_EXAMPLES) | PY_EXAMPLES
    assert present - covered == set(), "examples without a test: add them to tests/test_examples.py"
    assert covered - present == set(), "tests name examples that do not exist"


@pytest.mark.parametrize("name", sorted(YAML_EXAMPLES))
def test_yaml_example_validates(name: str) -> None:
    path = EXAMPLES / name
    assert path.read_text().splitlines()[0] == MODELINE
    pipeline = load_pipeline(path, registry=discover(), env={})
    nodes, runs_as = YAML_EXAMPLES[name]
    assert [n.id for n in pipeline.nodes] == nodes
    assert kv_transfer_config(pipeline)["kv_connector"] == runs_as


def test_native_example_exports_plain_multiconnector() -> None:
    config = kv_transfer_config(load_pipeline(EXAMPLES / "native-multiconnector.yaml", env={}))
    assert config == {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"},
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "shared_storage_path": "/tmp/kv-composer-storage"
                    },
                },
            ]
        },
    }


def test_offload_before_nixl_uses_longest_hit_with_nixl_as_transport() -> None:
    pipeline = load_pipeline(EXAMPLES / "offload-before-nixl.yaml")
    assert pipeline.load_policy == "longest_hit"
    assert pipeline.load_order == ("cpu", "nixl")
    assert pipeline.node("nixl").role == "transport"
    assert pipeline.node("nixl").capabilities.provides_handshake


def test_compose_py_builds_the_cpu_offload_pipeline() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "compose.py")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    expected = kv_transfer_config(load_pipeline(EXAMPLES / "cpu-offload.yaml"))
    assert json.loads(proc.stdout) == expected
