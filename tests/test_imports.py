"""Every import in ``composer/`` points down: no circle, no arrow from a lower layer to a
higher one, deferred imports (inside functions) included. A deferred import is for
lightness (``import composer`` and ``kvc validate`` load neither torch nor vLLM),
never to break a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "composer"

#: The layers, bottom first: a module may import its own layer's and lower ones'.
#: Data flows up: YAML (loader) -> validated model (pipeline, validation) ->
#: resolved graph -> chain -> vLLM adapter (vllm); the commands (cli) on top.
LAYERS: list[set[str]] = [
    {"loader", "controls", "stats", "trace", "scrape", "memory", "kv_caches", "servers", "ranges"},
    {"errors", "views", "plugin_types", "policy"},
    {"hook_table", "hookspecs", "plugin", "pipeline"},
    {"model"},
    {"builtin", "builtin_policies"},
    {"discovery", "export"},
    {"validation"},
    {"chain", "simulate", "bench"},
    {"vllm"},
    {"composer"},  # the public namespace (composer/__init__.py)
    {"testing"},
    {"cli"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines |= {n.lineno for n in ast.walk(inner) if hasattr(n, "lineno")}
    return lines


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, *([node.module] if node.module else [])])
        # ``from composer import scrape`` imports the module composer.scrape.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != module:
            out.append(name)
    return out


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and node.lineno not in skip:
                edges.setdefault(module, set()).update(_imported(module, node))
    return edges


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "composer"


def test_every_module_has_a_layer() -> None:
    assert sorted({_unit(m) for m in MODULES} - set(LAYER)) == []


def test_no_import_points_up() -> None:
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in _edges().items()
        for b in targets
        if LAYER[_unit(a)] < LAYER[_unit(b)]
    )
    assert upward == []


def test_no_import_circle() -> None:
    edges = _edges()
    circles: list[list[str]] = []

    def visit(module: str, path: list[str], done: set[str]) -> None:
        for target in sorted(edges.get(module, ())):
            if target in path:
                circles.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target, [*path, target], done)
        done.add(module)

    done: set[str] = set()
    for module in sorted(MODULES):
        if module not in done:
            visit(module, [module], done)
    assert circles == []


#: What ``import composer``, ``kvc validate`` and ``kvc --help`` must not load: a module
#: imported inside a function is one that loads one of these (directly or through
#: the composer modules it imports at its top).
HEAVY = {"torch", "vllm", "transformers", "lmcache", "nixl", "rich", "matplotlib"}


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported (not those in a function, nor
    under ``TYPE_CHECKING``)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody
            stack += [n for handler in node.handlers for n in handler.body]
    return found


def _external(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    return set() if node.level else {(node.module or "").split(".")[0]}


def _loads_heavy(module: str, seen: dict[str, bool]) -> bool:
    if module not in seen:
        seen[module] = False  # (a circle is another test's failure)
        imports = _top_level_imports(ast.parse(MODULES[module].read_text()))
        seen[module] = any(_external(node) & HEAVY for node in imports) or any(
            _loads_heavy(target, seen) for node in imports for target in _imported(module, node)
        )
    return seen[module]


def _deferred() -> list[tuple[str, int, str]]:
    """(module, line, composer module) of every composer import inside a function."""
    out = []
    for module, path in MODULES.items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import | ast.ImportFrom):
                        out += [(module, node.lineno, t) for t in _imported(module, node)]
    return out


def test_a_deferred_import_is_for_lightness() -> None:
    """A composer module is imported inside a function only when it loads a heavy
    library (:data:`HEAVY`) as it is imported: anything else goes at the top."""
    seen: dict[str, bool] = {}
    needless = [f"{m}:{line}: {target}" for m, line, target in _deferred()
                if not _loads_heavy(target, seen)]
    assert needless == []
    # (The check can fail: composer.cli.top loads rich, composer.errors nothing heavy.)
    assert _loads_heavy("composer.cli.top", seen) and not _loads_heavy("composer.errors", seen)


def test_the_check_sees_a_circle_and_an_upward_arrow() -> None:
    tree = ast.parse("from composer.cli.serve import serve\nimport composer.bench.run\n")
    found = [t for node in tree.body for t in _imported("composer.bench.fleet", node)]  # type: ignore[arg-type]
    assert found == ["composer.cli.serve", "composer.bench.run"]
    assert LAYER[_unit(found[0])] > LAYER["bench"]


# --------------------------------------------------------------------------- #
# Sizes a newcomer can hold in their head
# --------------------------------------------------------------------------- #

#: Modules allowed past MAX_MODULE_LINES: vLLM's grouping rules.
LONG_MODULES = {"composer.model.kv_groups"}
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def test_no_module_is_too_long() -> None:
    long = {
        m: len(p.read_text().splitlines())
        for m, p in MODULES.items()
        if m not in LONG_MODULES and len(p.read_text().splitlines()) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_is_too_long() -> None:
    long = [
        f"{m}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for m, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_init_files_only_hand_names_on() -> None:
    """A package's ``__init__.py``: its docstring, imports and ``__all__``, nothing else."""
    doing = []
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        for i, node in enumerate(ast.parse(path.read_text()).body):
            docstring = i == 0 and isinstance(node, ast.Expr)
            names = isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [
                "__all__"
            ]
            if not (docstring or names or isinstance(node, ast.Import | ast.ImportFrom)):
                doing.append(f"{module}:{node.lineno}: {type(node).__name__}")
    assert doing == []
