"""The plugin API: ``Plugin[ConfigT]``, ``PluginType``'s inferred fields and per-process
classes, and the docs' one-file plugin (docs/plugins.md) installed with pip and run."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from composer import Capabilities, Plugin, PluginType, discover, hookimpl
from composer.discovery import PluginLoadError
from composer.plugin import NodeContext
from composer.plugin_types import PluginTypeError

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


class Config(BaseModel):
    size: int = 1


class Sched(Plugin[Config]):
    pass


class Work(Plugin[Config]):
    pass


# --------------------------------------------------------------------------- #
# PluginType
# --------------------------------------------------------------------------- #


def test_one_class_runs_in_both_processes() -> None:
    t = PluginType("one", node=Sched)
    assert t.processes == {"scheduler", "worker"}
    assert t.node_class() is Sched
    assert t.node_class("scheduler") is Sched and t.node_class("worker") is Sched
    assert t.default_role == "both" and t.roles == {"load", "save", "both"}


def test_a_class_per_process() -> None:
    t = PluginType("two", scheduler=Sched, worker=Work)
    assert t.processes == {"scheduler", "worker"}
    assert t.node_class("scheduler") is Sched and t.node_class("worker") is Work
    with pytest.raises(PluginTypeError, match="has a class per vLLM process"):
        t.node_class()
    assert t.class_refs() == {"scheduler": Sched, "worker": Work}


@pytest.mark.parametrize(("given", "process"), [("scheduler", "worker"), ("worker", "scheduler")])
def test_one_process_class_makes_a_node_of_that_process(given: str, process: str) -> None:
    t = PluginType("half", **{given: Sched})  # type: ignore[arg-type]
    assert t.processes == {given}
    assert t.node_class() is Sched and t.node_class(given) is Sched  # type: ignore[arg-type]
    with pytest.raises(PluginTypeError, match=f"does not run in the {process} process"):
        t.node_class(process)  # type: ignore[arg-type]


def test_classes_as_strings_are_imported_on_demand() -> None:
    t = PluginType("lazy", scheduler=f"{__name__}:Sched", worker="json.decoder:JSONDecoder")
    assert t.node_class("scheduler") is Sched
    assert t.node_class("worker") is json.JSONDecoder


def _choose(config: Config) -> type:
    return Sched if config.size == 1 else Work


def test_a_class_chosen_from_the_config() -> None:
    """A function of the config in place of a class (a plugin whose classes differ by mode)."""
    t = PluginType("chosen", node=_choose, config=Config)
    assert t.node_class("scheduler", Config()) is Sched
    assert t.node_class("worker", Config(size=2)) is Work
    as_string = PluginType("chosen", node=f"{__name__}:_choose", config=Config)
    assert as_string.node_class("worker", Config(size=2)) is Work
    with pytest.raises(PluginTypeError, match="chooses its class from the node's config"):
        t.node_class("scheduler")


def test_default_role_is_inferred_from_a_single_role() -> None:
    assert PluginType("s", node=Sched, roles={"service"}).default_role == "service"
    assert PluginType("l", node=Sched, roles={"load"}).default_role == "load"
    # Several roles: "both" when allowed; an explicit default always wins.
    assert PluginType("b", node=Sched, roles={"load", "both"}).default_role == "both"
    assert PluginType("x", node=Sched, roles={"load", "both"}, default_role="load").default_role \
        == "load"
    # Several roles without "both": it must be named (discovery says so, below).
    assert PluginType("t", node=Sched, roles={"load", "transport"}).problems() == [
        'default_role "both" is not one of roles (load, transport); set default_role'
    ]


def test_capabilities_are_a_value_or_a_function_of_the_config() -> None:
    fixed = PluginType("f", node=Sched, config=Config, capabilities=Capabilities(hma=True))
    assert fixed.resolve_capabilities(Config()).hma

    def caps(config: Config) -> Capabilities:
        return Capabilities(async_save=config.size > 1)

    varying = PluginType("v", node=Sched, config=Config, capabilities=caps)
    assert not varying.resolve_capabilities(Config()).async_save
    assert varying.resolve_capabilities(Config(size=2)).async_save
    with pytest.raises(TypeError, match="capabilities_for"):  # one field, no old spelling
        PluginType("o", node=Sched, config=Config, capabilities_for=caps)  # type: ignore[call-arg]


def test_discovery_keeps_inferred_fields_through_its_copy() -> None:
    class Types:
        @hookimpl
        def register_plugin_types(self, register: Any) -> None:
            register(PluginType("two", scheduler=Sched, worker=Work, roles={"service"}))

    t = discover(extra=[Types()], entry_points=False)["two"]
    assert (t.processes, t.roles, t.default_role) == ({"scheduler", "worker"}, {"service"},
                                                       "service")
    assert dataclasses.replace(t, version="9") == dataclasses.replace(t, version="9")


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({}, "give node= (one class) or scheduler= / worker= (a class per process)"),
        ({"node": Sched, "worker": Work}, "give node= or worker=, not both"),
        ({"node": "no_colon"},
         "node must be a class, \"module:Class\" or a function, not 'no_colon'"),
        ({"scheduler": Sched, "processes": {"worker"}},
         "scheduler= is given but processes does not include scheduler"),
        ({"worker": Work, "processes": {"scheduler", "worker"}},
         "processes includes scheduler but no class is given for it"),
        ({"node": Sched, "processes": {"gpu"}},
         "processes must name scheduler and/or worker, not ['gpu']"),
        ({"node": Sched, "roles": "load"},
         "roles must name some of load, save, both, transport, service, not ['a', 'd', 'l', 'o']"),
        ({"node": Sched, "roles": ()},
         "roles must name some of load, save, both, transport, service, not nothing"),
    ],
)
def test_inconsistent_declarations_are_refused_at_discovery(
    kwargs: dict[str, Any], problem: str
) -> None:
    class Types:
        @hookimpl
        def register_plugin_types(self, register: Any) -> None:
            register(PluginType("odd", **kwargs))

    with pytest.raises(PluginLoadError) as info:
        discover(extra=[Types()], entry_points=False)
    assert problem in str(info.value)
    assert str(info.value).startswith('plugin "')


# --------------------------------------------------------------------------- #
# Plugin[ConfigT]
# --------------------------------------------------------------------------- #


def test_self_config_is_the_validated_config() -> None:
    node = Sched(NodeContext("n", Config(size=3), "both", "scheduler"))
    assert node.config.size == 3


def test_self_config_is_typed_for_mypy() -> None:
    """``make lint``'s mypy checks tests/typing/typed_plugin.py, where a typo in
    ``self.config`` must be an error (mypy's run costs a minute: not here)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "tests/typing" in config["files"] and config["warn_unused_ignores"] is True
    typed = (ROOT / "tests" / "typing" / "typed_plugin.py").read_text()
    assert "return self.config.sise  # type: ignore[attr-defined]" in typed


def test_no_type_ignore_left_in_the_plugins_nodes() -> None:
    for package in ("offload-cpu/kvc_offload_cpu", "model-tracker/kvc_model_tracker"):
        for path in (ROOT / "plugins" / package).glob("*.py"):
            assert "type: ignore" not in path.read_text(), path


# --------------------------------------------------------------------------- #
# The docs' plugin (docs/plugins.md), installed with pip
# --------------------------------------------------------------------------- #


def _readme_block(first_line: str) -> str:
    text = (ROOT / "docs" / "plugins.md").read_text()
    (block,) = [
        b for b in re.findall(r"^```\w+\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
        if b.startswith(first_line + "\n")
    ]
    return block


PIPELINE = """\
version: 1
nodes:
  stats:
    plugin: prompt-stats
    config: {min_prompt_tokens: 4}
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """docs/plugins.md's two files, ``pip install``ed into a directory of their own; the
    environment that puts it on the path (entry points are read from its dist-info)."""
    root = tmp_path_factory.mktemp("readme-plugin")
    project, target = root / "project", root / "site"
    project.mkdir()
    (project / "prompt_stats.py").write_text(_readme_block("# prompt_stats.py"))
    (project / "pyproject.toml").write_text(_readme_block("# pyproject.toml"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(project)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    assert list(target.glob("kv_prompt_stats-0.1.0.dist-info"))
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "KV_COMPOSER_PLUGINS": "prompt-stats"}


def _run(
    env: dict[str, str], *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, env={**os.environ, **env}, cwd=cwd,
        timeout=300,
    )


def test_installed_plugin_is_listed_and_validates_without_torch(
    installed: dict[str, str], tmp_path: Path
) -> None:
    proc = _run(installed, str(VENV_BIN / "kvc"), "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    types = {t["name"]: t for t in json.loads(proc.stdout)["plugin_types"]}
    stats = types["prompt-stats"]
    assert (stats["package"], stats["version"]) == ("kv-prompt-stats", "0.1.0")
    assert stats["classes"] == {"scheduler": "prompt_stats:PromptStats"}
    assert (stats["roles"], stats["default_role"]) == (["service"], "service")

    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "typo.yaml").write_text(PIPELINE.replace("min_prompt_tokens", "min_prompt_token"))
    code = (
        "import sys; from composer.cli import main; code = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, 'heavy import'; "
        "sys.exit(code)"
    )
    proc = _run(installed, sys.executable, "-c", code, "validate", "p.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("p.yaml: ok (1 node: stats;")
    proc = _run(installed, sys.executable, "-c", code, "validate", "typo.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    assert 'typo.yaml:5:14: nodes.stats.config.min_prompt_token: ' in proc.stdout
    assert 'did you mean "min_prompt_tokens"' in proc.stdout
    proc = _run(installed, str(VENV_BIN / "kvc"), "validate", "--deep", "p.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_installed_plugin_runs_in_a_chain(installed: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(PIPELINE)
    code = (
        "import json, types; from composer import load_pipeline; "
        "from composer.chain import chain_for; "
        "chain = chain_for(load_pipeline('p.yaml'), 'scheduler'); "
        "worker = chain_for(load_pipeline('p.yaml'), 'worker'); "
        "[chain.on_new_request(types.SimpleNamespace(request_id=f'r{n}', num_prompt_tokens=n)) "
        " for n in (10, 2, 6)]; "
        "print(json.dumps([sorted(chain.nodes), sorted(worker.nodes), chain.take_stats()]))"
    )
    proc = _run(installed, sys.executable, "-c", code, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    scheduler_nodes, worker_nodes, stats = json.loads(proc.stdout.splitlines()[-1])
    assert (scheduler_nodes, worker_nodes) == (["stats"], [])
    assert stats["stats"]["counters"]["extra"] == {"prompts": 2}


@pytest.mark.e2e
def test_installed_plugin_runs_in_vllm(
    installed: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from composer import load_pipeline
    from composer.export import kv_transfer_config
    from composer.testing.engine import EngineSpec, run_engine
    from composer.testing.tiny_model import build_tiny_model

    (tmp_path / "p.yaml").write_text(PIPELINE)
    env = installed
    # Exported here (this process needs the plugin too), run by vLLM's processes.
    monkeypatch.syspath_prepend(env["PYTHONPATH"].split(os.pathsep)[0])
    monkeypatch.setenv("KV_COMPOSER_PLUGINS", env["KV_COMPOSER_PLUGINS"])
    try:
        config = kv_transfer_config(load_pipeline(str(tmp_path / "p.yaml")))
    finally:
        sys.modules.pop("prompt_stats", None)
    prompts = ["hello " * 40, "hi", "the same prompt, again " * 8]
    result = run_engine(
        EngineSpec(model=str(build_tiny_model()), rounds=[prompts], kv_transfer_config=config,
                   max_tokens=4, env=env, enforce_eager=True, in_process=True)
    )
    assert [len(r.tokens) for r in result.rounds[0]] == [4, 4, 4]
    # The node logs each prompt of at least 4 tokens, in the scheduler process.
    log = re.sub(r"\x1b\[[0-9;]*m", "", result.log)  # structlog's colours, if any
    ours = ("node=stats", "process=scheduler")
    logged = [
        line
        for line in log.splitlines()
        if re.search(r"\]\s+prompt\s", line) and all(key in line for key in ours)
    ]
    long_enough = [r for r in result.rounds[0] if r.prompt_tokens >= 4]
    assert len(logged) == len(long_enough) >= 2, result.log_tail
