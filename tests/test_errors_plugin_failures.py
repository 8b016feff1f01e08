"""Errors of plugin code, at discovery and validation: a plugin type that is
malformed, or whose check, config validator or capabilities raise, exit or
yield nonsense, or whose module exits while imported, is a PluginLoadError
(an environment error) naming it, not a crash or a pipeline problem.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field, field_validator

from composer import Capabilities, PluginType, discover, hookimpl, validate_text
from composer.discovery import PluginLoadError


@pytest.mark.parametrize(
    "failure",
    ["raise", "exit", "bad-yield"],
)
@pytest.mark.parametrize("where", ["check", "validator", "capabilities"])
def test_a_failing_plugin_is_an_environment_error_not_a_crash(failure: str, where: str) -> None:
    def fail() -> Any:
        if failure == "exit":
            sys.exit(0)
        if failure == "raise" or where != "check":
            raise RuntimeError("plugin bug")
        return [("not", "a tuple path")]

    class Config(BaseModel):
        x: int = Field(1, validate_default=True)

        @field_validator("x")
        @classmethod
        def _x(cls, value: int) -> int:
            return fail() if where == "validator" else value  # type: ignore[no-any-return]

    class Types:
        @hookimpl
        def register_plugin_types(self, register: Callable[[PluginType], None]) -> None:
            register(
                PluginType(
                    name="buggy",
                    node="x:Y",
                    config=Config,
                    check=(lambda *_: fail()) if where == "check" else None,
                    capabilities=(
                        (lambda _: fail()) if where == "capabilities" else Capabilities()
                    ),
                )
            )

    registry = discover(extra=[Types()], entry_points=False)
    with pytest.raises(PluginLoadError, match=r'^plugin "buggy" failed while '):
        validate_text("version: 1\nnodes: {a: {plugin: buggy}}\n", registry=registry)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"config": dict}, 'plugin type "odd": config must be a pydantic model class'),
        ({"config": "Config"}, 'plugin type "odd": config must be a pydantic model class'),
        ({"check": 3}, 'plugin type "odd": check must be callable'),
        (
            {"capabilities": "x"},
            'plugin type "odd": capabilities must be a Capabilities or a function of the config',
        ),
        ({"name": ""}, "a plugin type needs a non-empty string name"),
    ],
)
def test_a_malformed_plugin_type_is_refused_at_discovery(
    kwargs: dict[str, Any], problem: str
) -> None:
    class Types:
        @hookimpl
        def register_plugin_types(self, register: Callable[[PluginType], None]) -> None:
            register(PluginType(**{"name": "odd", "node": "x:Y", **kwargs}))

    with pytest.raises(PluginLoadError, match=re.escape(problem)):
        discover(extra=[Types()], entry_points=False)


def test_a_plugin_module_that_exits_while_imported_is_an_environment_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvc_exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KV_COMPOSER_PLUGIN_MODULES", "kvc_exits_on_import")
    with pytest.raises(PluginLoadError, match=r"failed to import: SystemExit\(0\)"):
        discover(entry_points=False)
