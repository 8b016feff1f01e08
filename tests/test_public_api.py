"""Plugins use only the public namespaces: ``composer``, ``composer.vllm`` and ``composer.servers``;
their tests and benchmarks also ``composer.testing``'s modules (the test toolkit).

The modules below them may move (they did); a plugin that imports one breaks
with the move. Read with ``ast``, so no plugin module is imported here.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = ("composer", "composer.vllm", "composer.servers")
#: A ``"module:attr"`` string in composer (PluginType's class and function references).
_REF = re.compile(r"^(composer(?:\.\w+)*):")


def _exports(package: str) -> set[str]:
    """The package's ``__all__``, read from its ``__init__.py`` (composer.vllm imports vLLM)."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


EXPORTS = {package: _exports(package) for package in PUBLIC}


def private_uses(source: str, where: str, *, testing: bool = False) -> list[str]:
    """``where:line: ...`` for each import of (or reference to) composer below its public
    namespaces (``testing``: ``composer.testing``'s modules are public too), and each
    name imported from one that it does not export."""
    found = []
    for node in ast.walk(ast.parse(source)):
        modules: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, [a.name for a in node.names])]
        elif isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _REF.match(node.value)
            modules = [(match[1], [])] if match else []
        for module, names in modules:
            if module.split(".")[0] != "composer":
                continue
            if testing and module.startswith("composer.testing"):
                continue
            if module not in PUBLIC:
                found.append(f"{where}:{node.lineno}: uses {module}; use one of {PUBLIC}")
                continue
            for name in sorted(set(names) - EXPORTS[module]):
                found.append(f"{where}:{node.lineno}: {module} does not export {name}")
    return found


def _plugin_modules() -> list[Path]:
    return sorted(ROOT.glob("plugins/*/kvc_*/**/*.py"))


def test_every_plugin_package_is_found() -> None:
    # Guards the test below against passing on an empty glob.
    packages = {p.relative_to(ROOT).parts[:3] for p in _plugin_modules()}
    assert {pkg[1] for pkg in packages} >= {"offload-cpu", "lmcache", "model-tracker"}


def _plugin_tests_and_benchmarks() -> list[Path]:
    return sorted([*ROOT.glob("plugins/*/tests/*.py"), *ROOT.glob("plugins/*/benchmarks/*.py")])


def test_plugins_use_only_the_public_namespaces() -> None:
    found = []
    for path in _plugin_modules():
        found += private_uses(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


def test_plugins_tests_and_benchmarks_use_only_the_public_namespaces() -> None:
    paths = _plugin_tests_and_benchmarks()
    assert {p.relative_to(ROOT).parts[1] for p in paths} >= {"offload-cpu", "lmcache"}
    found = []
    for path in paths:
        found += private_uses(path.read_text(), str(path.relative_to(ROOT)), testing=True)
    assert found == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from composer import Plugin\nfrom composer.vllm import NativeConnectorNode", []),
        ("import json\nfrom composer.servers import ping, free_port", []),
        ("from composer.hookspecs import hookimpl", ["m.py:1: uses composer.hookspecs"]),
        ("\n\nimport composer.plugin", ["m.py:3: uses composer.plugin"]),
        ("def f():\n    from composer.vllm.native import X", ["m.py:2: uses composer.vllm.native"]),
        ("T = PluginType('t', node='composer.plugin:Plugin')", ["m.py:1: uses composer.plugin"]),
        ("from composer import Reporter", ["m.py:1: composer does not export Reporter"]),
        ("from . import composer\nfrom composerx.a import b\nx = 'composer.x is here'", []),
    ],
)
def test_private_uses_are_named_with_file_and_line(source: str, expected: list[str]) -> None:
    found = private_uses(source, "m.py")
    assert [f.split(";")[0] for f in found] == expected


@pytest.mark.parametrize("package", PUBLIC)
def test_each_public_namespace_has_what_it_exports(package: str) -> None:
    module = importlib.import_module(package)
    assert EXPORTS[package], f"{package} has no __all__"
    assert [n for n in sorted(EXPORTS[package]) if not hasattr(module, n)] == []
