"""Which tests the pass on vLLM's GPU release runs: those whose code reaches
vLLM, found from the source by a static import graph, not listed by hand.

What reaches vLLM: importing ``vllm`` or KV Composer's adapter to it
(``composer.vllm``). The graph is read with ``ast``; nothing is imported.

The unit is a test: a top-level ``test_*`` function or ``Test*`` class of a
test module. A test is chosen when the imports of the code it runs reach vLLM:

* its own body's imports, and the module's other imports (at module level,
  in fixtures and helper functions: any test may run those);
* a string naming a module of the repository or of vLLM counts as importing it
  (``[sys.executable, "-m", "composer.vllm.cli", ...]``), and a test taking the
  ``kvc`` fixture (the ``kvc`` console script, run as a subprocess) imports
  ``composer.cli``;
* followed through the files imported: test helper modules (anything outside
  the library packages ``composer``, ``benchmarks`` and the plugins' packages)
  count with all their imports; so does a library module the test's own code
  imports (a test calls its functions, and KV Composer imports vLLM lazily,
  inside the functions that need it); a library module reached only through
  another library module counts with its import-time imports (module level,
  not ``if TYPE_CHECKING:``) alone: whether one of its functions runs is not
  something an import graph knows, and counting them all would choose nearly
  every test (``composer.chain`` imports ``composer.validation.deep_check`` for
  one helper, deep checks import vLLM in another function; every command of
  ``kvc`` is one import away from the ones that use vLLM);
* the command-line flags in :data:`FLAG_MODULES`, written in a test, count as
  importing the module that does their work: the one way a ``kvc`` command
  reaches vLLM that its test cannot show by an import (``kvc validate --deep``).

So a test is left out when vLLM is only reachable through a function of a
library module it does not import itself, through a conftest fixture (the root
``plain_llama`` starts engines, which this pass does not run) or through a
plugin loaded by entry point at run time. ``--why`` prints each chosen test's
way to vLLM.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Imports that are vLLM for this purpose: vLLM, and KV Composer's adapter to it.
VLLM = ("vllm", "composer.vllm")
#: Fixtures that run a console script of this repository, and the module it runs.
FIXTURE_MODULES = {"kvc": "composer.cli"}
#: ``kvc`` flags that make a command use vLLM, and the module that does it.
FLAG_MODULES = {"--deep": "composer.validation.deep_check"}


@dataclass(frozen=True)
class Imports:
    """What a file imports: at import time, anywhere, and per test unit."""

    import_time: frozenset[str]
    anywhere: frozenset[str]
    #: outside the test units: module level, fixtures, helper functions
    shared: frozenset[str]
    #: test module only: unit name -> the imports inside it
    units: tuple[tuple[str, frozenset[str]], ...]


def all_test_modules() -> list[Path]:
    """Every test module pytest collects here (``testpaths``: tests, plugins)."""
    found = [*ROOT.glob("tests/**/test_*.py"), *ROOT.glob("plugins/*/tests/**/test_*.py")]
    return sorted(found)


#: In :func:`chosen`'s answer, the name that stands for every test of a module
#: (its module-level code reaches vLLM; tests it adds at run time included).
EVERY_TEST = "*"


def chosen() -> dict[Path, dict[str, list[str]]]:
    """Test module -> its chosen tests (or :data:`EVERY_TEST`) -> their way to
    vLLM (the files on the way, then the import)."""
    out: dict[Path, dict[str, list[str]]] = {}
    for path in all_test_modules():
        imports = _imports(path)
        shared = _way(path, imports.shared)
        if shared:
            out[path] = {EVERY_TEST: shared}
            continue
        tests = {unit: _way(path, names) for unit, names in imports.units}
        tests = {unit: way for unit, way in tests.items() if way}
        if tests:
            out[path] = tests
    return out


def engine_module(path: Path) -> bool:
    """Whether every test of ``path`` is an engine test (``pytestmark =
    pytest.mark.e2e`` at module level), which the pass leaves out."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return ast.unparse(node.value) == "pytest.mark.e2e"
    return False


def _way(path: Path, names: frozenset[str]) -> list[str]:
    """How ``names``, imported by ``path``'s own code, reach vLLM (empty if not)."""
    for name in sorted(names):
        if _is_vllm(name):
            return [str(path.relative_to(ROOT)), name]
    for name in sorted(names):
        target = _resolve(name, path)
        if target is not None and target != path:
            # Every import of a helper or of a library module the test imports.
            way = _way_from(target, True)
            if way:
                return [str(path.relative_to(ROOT)), *way]
    return []


@cache
def _way_from(file: Path, everything: bool) -> tuple[str, ...]:
    """How ``file`` reaches vLLM, counting its imports anywhere or only its
    import-time ones (breadth first: the shortest way)."""
    start = (file, everything)
    came_from: dict[tuple[Path, bool], tuple[Path, bool] | None] = {start: None}
    todo = [start]
    while todo:
        current = todo.pop(0)
        imports = _imports(current[0])
        for name in sorted(imports.anywhere if current[1] else imports.import_time):
            if _is_vllm(name):
                way = [name]
                step: tuple[Path, bool] | None = current
                while step is not None:
                    way.insert(0, str(step[0].relative_to(ROOT)))
                    step = came_from[step]
                return tuple(way)
            target = _resolve(name, current[0])
            if target is None:
                continue
            # Beyond the test's own imports: every import of a helper, the
            # import-time ones of a library module (see the module docstring).
            state = (target, not _is_library(target))
            if state not in came_from and (target, True) not in came_from:
                came_from[state] = current
                todo.append(state)
    return ()


def _is_vllm(name: str) -> bool:
    return any(name == v or name.startswith(v + ".") for v in VLLM)


@cache
def _roots() -> dict[str, Path]:
    """Top-level importable names of this repository's packages -> their folder."""
    roots = {"composer": ROOT / "composer", "benchmarks": ROOT / "benchmarks"}
    for package in ROOT.glob("plugins/*/*/__init__.py"):
        roots[package.parent.name] = package.parent
    return roots


def _is_library(path: Path) -> bool:
    return any(path.is_relative_to(folder) for folder in _roots().values())


def _resolve(name: str, importer: Path) -> Path | None:
    """The repository file ``name`` denotes when ``importer`` imports it (the
    longest prefix of it that is a module: ``from a import b`` may name an
    attribute), or None for anything outside the repository."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        for base in _bases(parts[0], importer):
            candidate = base.joinpath(*parts[1:end])
            for file in (candidate.with_suffix(".py"), candidate / "__init__.py"):
                if file.is_file():
                    return file
    return None


def _bases(first: str, importer: Path) -> Iterator[Path]:
    root = _roots().get(first)
    if root is not None:
        yield root
    # pytest's default import mode puts a test module's first folder up without
    # an ``__init__.py`` on sys.path: its helper modules import by bare name.
    folder = importer.parent
    while (folder / "__init__.py").is_file():
        folder = folder.parent
    yield folder / first


@cache
def _imports(path: Path) -> Imports:
    tree = ast.parse(path.read_text(), str(path))
    package = _package(path)
    import_time: set[str] = set()
    for statement in _walk(tree, into_functions=False):
        import_time |= _named(statement, package)
    anywhere: set[str] = set()
    for node in _walk(tree, into_functions=True):
        anywhere |= _named(node, package)
    units = []
    shared = set(import_time)
    for node in tree.body:
        is_test = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
            node.name.startswith("test")
        )
        is_unit = is_test or (isinstance(node, ast.ClassDef) and node.name.startswith("Test"))
        names: set[str] = set()
        for inner in _walk(node, into_functions=True):
            names |= _named(inner, package)
        if is_unit and path.name.startswith("test_"):
            units.append((node.name, frozenset(names)))
        else:
            shared |= names
    return Imports(frozenset(import_time), frozenset(anywhere), frozenset(shared), tuple(units))


def _named(node: ast.AST, package: list[str]) -> set[str]:
    """The modules ``node`` imports or names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package[: len(package) - node.level + 1]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        return {module, *(f"{module}.{alias.name}" for alias in node.names)}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if node.value in FLAG_MODULES:
            return {FLAG_MODULES[node.value]}
        return {node.value} if _names_module(node.value) else set()
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        arguments = {a.arg for a in node.args.args}
        return {m for fixture, m in FIXTURE_MODULES.items() if fixture in arguments}
    return set()


def _names_module(text: str) -> bool:
    """A dotted module name of this repository or vLLM (``"composer.cli"``; not a
    lone word such as ``"vllm"``, which names the plugin as often as the package)."""
    parts = text.split(".")
    return (
        len(parts) > 1
        and (parts[0] in _roots() or parts[0] == "vllm")
        and all(part.isidentifier() for part in parts)
    )


def _walk(tree: ast.AST, into_functions: bool) -> Iterator[ast.AST]:
    """``ast.walk`` not entering ``if TYPE_CHECKING:`` blocks (they never run),
    nor function bodies unless ``into_functions`` (a function's signature is
    still seen: its ``kvc`` fixture argument, its default values)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                todo.extend(child.orelse)
            elif not into_functions and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if child not in node.body:
                    todo.append(child)
            else:
                todo.append(child)


def _type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _package(path: Path) -> list[str]:
    """The dotted package ``path`` is in, as relative imports count it."""
    parts: list[str] = []
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return parts


if __name__ == "__main__":
    # The chosen tests as pytest node ids (module::test); ``--why``: each one's
    # way to vLLM.
    for path, tests in chosen().items():
        for unit, way in tests.items():
            why = "  <- " + " -> ".join(way) if "--why" in sys.argv else ""
            test = "" if unit == EVERY_TEST else f"::{unit}"
            print(f"{path.relative_to(ROOT)}{test}{why}")
