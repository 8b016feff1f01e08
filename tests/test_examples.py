"""Every file in examples/ is exercised here (a file no test covers fails the suite),
and so is every example in the README and the pages under docs/."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pluggy
import pytest
from kvc_offload_cpu.index import BlockIndex

from composer import (
    Node,
    NodeContext,
    Pipeline,
    PipelineInvalid,
    RequestView,
    discover,
    kv_transfer_config,
    load_pipeline,
    validate_text,
)
from composer.cli import main
from composer.discovery import ALLOW_ENV, DENY_ENV, ENTRY_POINT_GROUP
from composer.hookspecs import PROJECT, NodeSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODELINE = "# yaml-language-server: $schema=../schemas/pipeline.schema.json"

#: What each YAML example claims about itself: (nodes in dependency order, runs as).
YAML_EXAMPLES = {
    "native-multiconnector.yaml": (["nixl", "storage"], "MultiConnector"),
    "cpu-offload.yaml": (["cpu"], "ComposedConnector"),
    "offload-before-nixl.yaml": (["cpu", "nixl"], "ComposedConnector"),
    "tracker-offload-lmcache.yaml": (["tracker", "cpu", "lmcache"], "ComposedConnector"),
    "fleet-valkey.yaml": (["cpu", "lmcache"], "ComposedConnector"),
    # Also each engine of tests/e2e/test_fleet_e2e.py's fleet behind vllm-router.
    "fleet-cpu-events.yaml": (["cpu"], "ComposedConnector"),
    # Also each engine of plugins/offload-cpu/tests/test_e2e_ranges.py.
    "tiers-ranges.yaml": (["fast", "slow"], "ComposedConnector"),
    # Also the prefill and the decode engine of tests/e2e/test_pd_e2e.py.
    "pd-nixl.yaml": (["cpu", "nixl"], "ComposedConnector"),
    "tenants.yaml": (["cpu"], "ComposedConnector"),
}
#: tier_controls.py runs against a real `kvc serve` in tests/e2e/test_serve_e2e.py;
#: cache_policy_fifo.py is chosen by name in tests/test_cache_policies.py.
PY_EXAMPLES = {"compose.py", "tier_controls.py", "cache_policy_fifo.py"}


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


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_pd_example_serves_each_side(side: str) -> None:
    pipeline = load_pipeline(EXAMPLES / "pd-nixl.yaml", env={}, kv_role=side)
    assert kv_transfer_config(pipeline)["kv_role"] == f"kv_{side}"
    assert pipeline.node("nixl").role == "transport"


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
                        "shared_storage_path": "kv-composer-storage"
                    },
                },
            ]
        },
    }


def test_tenants_example_gives_each_tenant_its_share_of_the_tier() -> None:
    (cpu,) = load_pipeline(EXAMPLES / "tenants.yaml").nodes
    assert cpu.config.quotas == {"chat": 0.6, "agents": 0.3, "*": 0.1}
    index = BlockIndex(1000, quotas=cpu.config.quotas)
    assert index.quotas is not None
    assert index.quotas.limit == {"chat": 600, "agents": 300, "*": 100}
    assert index.quotas.of("a-user-no-quota-names") == "*"


def test_offload_before_nixl_uses_longest_hit_with_nixl_as_transport() -> None:
    pipeline = load_pipeline(EXAMPLES / "offload-before-nixl.yaml")
    assert pipeline.load_policy == "longest_hit"
    assert pipeline.load_order == ("cpu", "nixl")
    assert pipeline.node("nixl").role == "transport"
    assert pipeline.node("nixl").capabilities.provides_handshake


def test_lmcache_gets_the_model_from_the_tracker() -> None:
    pipeline = load_pipeline(EXAMPLES / "tracker-offload-lmcache.yaml")
    assert pipeline.node("lmcache").needs == ("tracker",)
    assert pipeline.node("tracker").capabilities.provides_model
    assert pipeline.load_order == ("cpu", "lmcache")
    assert pipeline.annotate_outputs


def test_fleet_example_shares_valkey_and_keeps_a_disk_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VALKEY_PASSWORD", "from-the-environment")
    monkeypatch.delenv("VALKEY_HOST", raising=False)
    pipeline = load_pipeline(EXAMPLES / "fleet-valkey.yaml")
    resp, disk = pipeline.node("lmcache").config.server.l2  # type: ignore[attr-defined]
    assert (resp.type, resp.host, resp.port, resp.password_env) == (
        "resp", "127.0.0.1", 6379, "VALKEY_PASSWORD"
    )
    assert resp.adapter_env() == {"LMCACHE_RESP_PASSWORD": "from-the-environment"}
    assert (disk.type, disk.path) == ("fs", "/var/cache/kv-composer/lmcache")
    assert pipeline.load_policy == "longest_hit" and pipeline.load_order == ("cpu", "lmcache")


def test_compose_py_builds_the_cpu_offload_pipeline() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "compose.py")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    expected = kv_transfer_config(load_pipeline(EXAMPLES / "cpu-offload.yaml"))
    assert json.loads(proc.stdout) == expected


# --------------------------------------------------------------------------- #
# The README's and the docs' examples are examples too.
# --------------------------------------------------------------------------- #

README = EXAMPLES.parent / "README.md"
#: The README and every page of the documentation.
PAGES = [README, *sorted((EXAMPLES.parent / "docs").glob("*.md"))]


def _blocks(lang: str) -> list[str]:
    return [
        block
        for page in PAGES
        for block in re.findall(
            rf"^```{lang}\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL
        )
    ]


def _block_starting(lang: str, first_line: str) -> str:
    (block,) = [b for b in _blocks(lang) if b.startswith(first_line + "\n")]
    return block


def test_the_docs_pipelines_validate(tmp_path: Path) -> None:
    # A pipeline that needs a package the page writes first ("# p.yaml (needs kvc-lfu
    # installed)") is validated by that page's own test (tests/test_policy_plugins.py).
    pipelines = [
        b
        for b in _blocks("yaml")
        if not b.startswith("# broken.yaml") and "(needs " not in b.partition("\n")[0]
    ]
    assert pipelines
    for text in pipelines:
        validate_text(text, file="README.md", env={})


def test_the_docs_error_example_is_what_kvc_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.yaml").write_text(_block_starting("yaml", "# broken.yaml"))
    shown = _block_starting("text", "$ kvc validate broken.yaml").splitlines()[1:]
    assert main(["validate", "broken.yaml"]) == 2
    out, err = capsys.readouterr()
    assert (out + err).splitlines() == shown


def test_the_docs_python_api_example_runs(tmp_path: Path) -> None:
    """Run where a user would: beside their pipeline.yaml (the README's first pipeline)."""
    (code,) = [b for b in _blocks("python") if b.startswith("import json\n")]
    (first,) = [b for b in _blocks("yaml") if "# the node with the longest hit" in b]
    (tmp_path / "pipeline.yaml").write_text(first)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "['cpu', 'nixl'] ('cpu', 'nixl') longest_hit"
    assert json.loads(lines[1])["kv_connector"] == "ComposedConnector"
    assert lines[2] == str(8 * 1024**3)


def test_the_docs_plugin_example_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process; tests/test_plugin_api.py installs the same two files with pip."""
    code = _block_starting("python", "# prompt_stats.py")
    assert len(code.splitlines()) <= 25, "the README's plugin is meant to be one small file"
    (tmp_path / "prompt_stats.py").write_text(code)
    toml = _block_starting("toml", "# pyproject.toml")
    assert f"[project.entry-points.{ENTRY_POINT_GROUP}]" in toml
    assert 'prompt-stats = "prompt_stats"' in toml

    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        registry = discover(extra=[importlib.import_module("prompt_stats")], entry_points=False)
        pipeline = validate_text(
            "version: 1\nnodes:\n  stats: {plugin: prompt-stats, config: {min_prompt_tokens: 4}}\n",
            registry=registry,
        )
        rnode = pipeline.node("stats")
        assert rnode.role == "service" and rnode.plugin.processes == {"scheduler"}
        with pytest.raises(PipelineInvalid, match='did you mean "min_prompt_tokens"'):
            validate_text(
                "version: 1\nnodes:\n  s: {plugin: prompt-stats, config: {min_prompt_token: 4}}\n",
                registry=registry,
            )

        node = rnode.plugin.node_class("scheduler")(
            NodeContext(node_id="stats", config=rnode.config, role="service", process="scheduler")
        )
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(NodeSpec)
        pm.register(node, name="stats")
        pm.check_pending()
        for tokens in (10, 2, 6):
            raw = types.SimpleNamespace(request_id=f"r{tokens}", num_prompt_tokens=tokens)
            pm.hook.on_new_request(request=RequestView(raw))
        assert node.stats.extra == {"prompts": 2}
    finally:
        sys.modules.pop("prompt_stats", None)


def test_the_docs_document_every_pipeline_field() -> None:
    text = (EXAMPLES.parent / "docs" / "pipelines.md").read_text()
    for model in (Pipeline, Node):
        for field in model.model_fields:
            assert f"| `{field}` |" in text, (
                f"docs/pipelines.md does not document {model.__name__}.{field}"
            )
