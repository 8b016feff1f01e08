"""``kvc validate --deep``: every node class imported, checked and registered, problems
located at the node."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from composer import Plugin, hookimpl
from composer.cli import main
from composer.discovery import MODULES_ENV
from composer.validation.deep_check import class_problems, unsupported_hookimpl_options

#: A plugin module with one good type and one broken in each way --deep catches.
PLUGINS = '''
from typing import Any

from pydantic import BaseModel, ConfigDict

from composer import Plugin, PluginType, hookimpl


class Good(Plugin):
    @hookimpl
    def on_new_request(self, request: Any) -> None: ...


class Misspelled(Plugin):
    @hookimpl
    def on_new_reqest(self, request: Any) -> None: ...


class BadArgument(Plugin):
    @hookimpl
    def get_finished(self, finished_req_id: set[str]) -> None: ...


class Wrapper(Plugin):
    @hookimpl(wrapper=True)
    def get_finished(self, finished_req_ids: set[str]) -> Any:
        return (yield)

    @hookimpl(trylast=True)
    def on_new_request(self, request: Any) -> None: ...


class NotAPlugin:
    pass


class NeedsALibrary(Plugin):
    """What only this machine's libraries tell (``launch_problems``)."""

    @classmethod
    def launch_problems(cls, config: Any) -> list[str]:
        return ["the installed somelib 2.0 lacks somelib.internal (tested: 1.0)"]


class CheckRaises(Plugin):
    @classmethod
    def launch_problems(cls, config: Any) -> list[str]:
        raise ImportError("somelib")


class ChooseConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    broken: bool = False


def choose(config: ChooseConfig) -> type:
    return Misspelled if config.broken else Good


TYPES = {
    "good": dict(node=Good),
    "split": dict(scheduler="deep_plugins:Good", worker="deep_plugins:Goood"),
    "no-module": dict(node="deep_plugin:Good"),
    "nested": dict(node="deep_plugins:Good.Inner"),
    "malformed": dict(node="deep_plugins:Good-x"),
    "misspelled": dict(node=Misspelled),
    "bad-argument": dict(worker=BadArgument),
    "wrapper": dict(node=Wrapper),
    "not-a-plugin": dict(node="deep_plugins:NotAPlugin"),
    "raises": dict(node="deep_raising:Node"),
    "chooser": dict(node="deep_plugins:choose", config=ChooseConfig),
    "needs-a-library": dict(node=NeedsALibrary),
    "check-raises": dict(node=CheckRaises),
}


@hookimpl
def register_plugin_types(register: Any) -> None:
    for name, classes in TYPES.items():
        register(PluginType(name, **classes))
'''


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "deep_plugins.py").write_text(PLUGINS)
    (tmp_path / "deep_raising.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(MODULES_ENV, "deep_plugins")
    monkeypatch.setenv("KV_COMPOSER_PLUGINS", "none-installed")  # only these
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in ("deep_plugins", "deep_raising"):
        sys.modules.pop(name, None)


def _file(path: Path, *plugins: str) -> Path:
    nodes = "".join(f"  n{i}:\n    plugin: {p}\n" for i, p in enumerate(plugins))
    path.write_text("version: 1\nnodes:\n" + nodes)
    return path


def _validate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["validate", *args])
    out, err = capsys.readouterr()
    return code, out + err


def test_a_good_node_class_passes(plugins: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _file(plugins / "ok.yaml", "good")
    code, out = _validate(capsys, "--deep", "ok.yaml")
    assert code == 0, out
    assert out.startswith("ok.yaml: ok (1 node: n0;")


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (
            "split",
            'plugin type "split": worker class "deep_plugins:Goood": "deep_plugins" has no '
            'class "Goood" (did you mean "Good"?)',
        ),
        (
            "no-module",
            'plugin type "no-module": class "deep_plugin:Good": no module '
            '"deep_plugin" (did you mean "deep_plugins"?)',
        ),
        (
            "nested",
            'plugin type "nested": class "deep_plugins:Good.Inner": "Good" has no class '
            '"Inner"',
        ),
        (
            "malformed",
            'plugin type "malformed": class "deep_plugins:Good-x": is not a "module:Class" '
            "name",
        ),
        (
            "misspelled",
            'plugin type "misspelled": class deep_plugins.Misspelled: '
            '"on_new_reqest" is not a hook (did you mean "on_new_request"?)',
        ),
        (
            "bad-argument",
            'plugin type "bad-argument": worker class deep_plugins.BadArgument: hook '
            '"get_finished" has no argument "finished_req_id" (did you mean '
            '"finished_req_ids"?); it passes: finished_req_ids',
        ),
        (
            "not-a-plugin",
            'plugin type "not-a-plugin": class "deep_plugins:NotAPlugin": does not '
            "subclass composer.plugin.Plugin",
        ),
        (
            "raises",
            'plugin type "raises": class "deep_raising:Node" failed to import: '
            "RuntimeError: no GPU here",
        ),
    ],
)
def test_a_broken_node_class_is_located_at_the_node(
    plugins: Path, capsys: pytest.CaptureFixture[str], plugin: str, message: str
) -> None:
    _file(plugins / "bad.yaml", "good", plugin)
    # Without --deep nothing is imported: the file is valid.
    assert _validate(capsys, "bad.yaml")[0] == 0
    code, out = _validate(capsys, "--deep", "bad.yaml")
    assert code == 2
    # Line 6, column 13: the second node's `plugin:` value.
    assert f"bad.yaml:6:13: nodes.n1.plugin: {message}\n" in out
    assert "Traceback" not in out


def test_a_class_chosen_from_the_config_is_the_one_checked(
    plugins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (plugins / "ok.yaml").write_text("version: 1\nnodes:\n  c: {plugin: chooser}\n")
    assert _validate(capsys, "--deep", "ok.yaml")[0] == 0
    (plugins / "bad.yaml").write_text(
        "version: 1\nnodes:\n  c: {plugin: chooser, config: {broken: true}}\n"
    )
    code, out = _validate(capsys, "--deep", "bad.yaml")
    assert code == 2
    assert out.startswith(
        'bad.yaml:3:15: nodes.c.plugin: plugin type "chooser": class "deep_plugins:choose" '
        '(chose deep_plugins.Misspelled): "on_new_reqest" is not a hook (did you mean '
        '"on_new_request"?)\n'
    )


def test_every_process_and_every_problem_is_reported(
    plugins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _file(plugins / "bad.yaml", "split", "wrapper")
    code, out = _validate(capsys, "--deep", "--json", "bad.yaml")
    assert code == 2
    (checked,) = json.loads(out)["files"]
    problems = [(p["path"], p["line"], p["message"]) for p in checked["problems"]]
    honour = "which the chain does not honour (nodes are called once each, in pipeline order)"
    wrapper = 'plugin type "wrapper": class deep_plugins.Wrapper: hook '
    assert sorted(problems) == [
        (
            "nodes.n0.plugin",
            4,
            'plugin type "split": worker class "deep_plugins:Goood": "deep_plugins" has '
            'no class "Goood" (did you mean "Good"?)',
        ),
        ("nodes.n1.plugin", 6, wrapper + f'"get_finished" is marked wrapper=True, {honour}'),
        ("nodes.n1.plugin", 6, wrapper + f'"on_new_request" is marked trylast=True, {honour}'),
    ]


def test_unsupported_hookimpl_options_names_hook_and_option() -> None:
    class Node(Plugin):
        @hookimpl(hookwrapper=True)
        def wait_for_save(self) -> Any:
            yield

        @hookimpl(tryfirst=True, trylast=True)
        def on_new_request(self, request: Any) -> None: ...

        @hookimpl(specname="shutdown", wrapper=True)
        def stop(self) -> Any:
            return (yield)

        @hookimpl
        def get_finished(self, finished_req_ids: set[str]) -> None: ...

    assert sorted(unsupported_hookimpl_options(Node)) == [
        ("on_new_request", "tryfirst"),
        ("on_new_request", "trylast"),
        ("shutdown", "wrapper"),
        ("wait_for_save", "hookwrapper"),
    ]

    class Plain(Plugin):
        @hookimpl
        def get_finished(self, finished_req_ids: set[str]) -> None: ...

    assert unsupported_hookimpl_options(Plain) == []
    assert class_problems(Plain) == []


def test_the_installed_plugins_pass_deep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """offload-cpu's per-process classes and model-tracker's worker class, imported for real."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(
        textwrap.dedent(
            """\
            version: 1
            nodes:
              tracker: {plugin: model-tracker}
              cpu: {plugin: offload-cpu, config: {capacity: 1GiB}}
            """
        )
    )
    code, out = _validate(capsys, "--deep", "p.yaml")
    assert code == 0, out


def test_a_node_class_says_what_keeps_it_from_running_here(
    plugins: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _file(plugins / "p.yaml", "good", "needs-a-library", "check-raises")
    code, out = _validate(capsys, "p.yaml")
    assert code == 0, out  # only --deep asks the classes
    code, out = _validate(capsys, "--deep", "p.yaml")
    assert code == 2
    assert (
        "p.yaml:6:13: nodes.n1.plugin: the installed somelib 2.0 lacks somelib.internal "
        "(tested: 1.0)" in out
    ), out
    assert (
        'p.yaml:8:13: nodes.n2.plugin: plugin type "check-raises": class '
        "deep_plugins.CheckRaises failed checking what it needs: ImportError: somelib" in out
    ), out
    assert "nodes.n0" not in out and "Traceback" not in out
