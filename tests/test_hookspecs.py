"""The hook specification: pluggy validates implementations, docs/hooks.md documents every hook."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pluggy
import pytest
from pluggy._hooks import varnames

from composer import EmptyConfig, NodeContext, Plugin, hookimpl
from composer.hook_table import HOOKS, Process, markdown_table
from composer.hookspecs import PROJECT, DiscoverySpec, NodeSpec


def _hooks(spec: type) -> dict[str, str]:
    """``name -> "name(arg, ...)"`` for every hookspec of a spec class, self left out."""
    out = {}
    for name, func in inspect.getmembers(spec, inspect.isfunction):
        if getattr(func, f"{PROJECT}_spec", None) is None:
            continue
        args, _ = varnames(func)
        out[name] = f"{name}({', '.join(args)})"
    return out


def _node(cls: type[Plugin]) -> Plugin:
    return cls(NodeContext(node_id="n", config=EmptyConfig(), role="both", process="worker"))


NODE_HOOKS = _hooks(NodeSpec)
DISCOVERY_HOOKS = _hooks(DiscoverySpec)


def test_spec_classes_are_what_we_think() -> None:
    # Guards the helper above: a change in pluggy's marker attribute would empty both.
    assert "start_load_kv" in NODE_HOOKS
    assert NODE_HOOKS["save_kv_layer"] == "save_kv_layer(layer_name, kv_layer, attn_metadata)"
    assert DISCOVERY_HOOKS == {
        "register_plugin_types": "register_plugin_types(register)",
        "register_cache_policies": "register_cache_policies(register)",
    }


def test_check_pending_catches_a_misspelled_hookimpl() -> None:
    class Typo(Plugin):
        @hookimpl
        def start_lod_kv(self, forward_context: object) -> None:
            pass

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(NodeSpec)
    pm.register(_node(Typo), name="typo")
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'start_lod_kv'"):
        pm.check_pending()


def test_register_rejects_an_argument_the_hook_does_not_have() -> None:
    class Extra(Plugin):
        @hookimpl
        def start_load_kv(self, forward_context: object, layer: int) -> None:
            pass

    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(NodeSpec)
    with pytest.raises(pluggy.PluginValidationError, match="layer"):
        pm.register(_node(Extra), name="extra")


def test_every_hookspec_has_a_docstring() -> None:
    for spec in (NodeSpec, DiscoverySpec):
        for name in _hooks(spec):
            doc = inspect.getdoc(getattr(spec, name))
            assert doc and doc.strip(), f"{spec.__name__}.{name} has no docstring"


# A documented hook is a list item, table row or heading that starts with its
# backticked signature.
_DOCUMENTED = re.compile(r"^\s*(?:[-*|]|#{3,})\s+`(\w+)\(([^)`]*)\)`", re.MULTILINE)


def _hooks_section(page: str) -> str:
    match = re.search(r"^# Hooks\n(.*?)\Z", page, re.MULTILINE | re.DOTALL)
    assert match, 'docs/hooks.md has no "# Hooks" title'
    return match.group(1)


def test_the_docs_document_every_hook_with_its_signature(root: Path) -> None:
    section = _hooks_section((root / "docs" / "hooks.md").read_text())
    documented = {f"{m.group(1)}({m.group(2).strip()})" for m in _DOCUMENTED.finditer(section)}
    expected = set(NODE_HOOKS.values()) | set(DISCOVERY_HOOKS.values())
    missing = sorted(expected - documented)
    stale = sorted(documented - expected)
    assert not missing and not stale, (
        f"docs/hooks.md is out of date.\n  missing: {missing}\n  stale: {stale}"
    )


def test_the_docs_document_each_hook_once(root: Path) -> None:
    section = _hooks_section((root / "docs" / "hooks.md").read_text())
    names = [m.group(1) for m in _DOCUMENTED.finditer(section)]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_the_docs_hook_table_is_the_one_the_spec_declares(root: Path) -> None:
    readme = (root / "docs" / "hooks.md").read_text()
    begin, end = "<!-- hook table: generated from composer.hook_table.HOOKS -->\n", "<!-- end"
    match = re.search(re.escape(begin) + "(.*?)" + re.escape(end), readme, re.DOTALL)
    assert match, "docs/hooks.md has no generated hook table"
    assert match.group(1) == markdown_table(), (
        "docs/hooks.md's hook table is out of date: paste the output of "
        "composer.hook_table.markdown_table()"
    )


def test_every_lifecycle_hookspec_has_a_row_and_every_row_a_hookspec() -> None:
    assert list(HOOKS) == [n for n in NodeSpec.__dict__ if n in NODE_HOOKS]
    assert set(HOOKS) == set(NODE_HOOKS)
    for name, row in HOOKS.items():
        assert row.signature == NODE_HOOKS[name]


def test_importing_the_table_first_gives_every_row() -> None:
    """Rows are recorded as ``composer.hookspecs`` declares its specs, and ``import
    composer`` imports it: a fresh interpreter importing the table first sees them all."""
    code = "from composer.hook_table import HOOKS; print(len(HOOKS))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(done.stdout) == len(HOOKS)


def _chain_of(process: Process) -> type:
    """The chain class that runs a hook of ``process`` (either: the core both build on)."""
    from composer.chain import ChainCore, SchedulerChain, WorkerChain

    return {
        Process.SCHEDULER: SchedulerChain,
        Process.WORKER: WorkerChain,
        Process.EITHER: ChainCore,
    }[process]


def test_the_recipe_for_a_hook_holds_for_every_hook() -> None:
    """The steps of hook_table's "Adding a hook": a method of its process's chain and
    sample arguments."""
    from composer.testing.chains import request, sample_args

    missing = [
        h for h, row in HOOKS.items() if not callable(getattr(_chain_of(row.process), h, None))
    ]
    assert missing == []
    assert sorted(set(HOOKS) ^ set(sample_args(request()))) == []


def test_every_hook_is_a_method_of_exactly_the_chain_of_its_process() -> None:
    """Scheduler hooks on SchedulerChain, worker hooks on WorkerChain, either-process
    hooks on ChainCore (so on both): the table and the classes cannot drift."""
    from composer.chain import ChainCore, SchedulerChain, WorkerChain

    chains = (ChainCore, SchedulerChain, WorkerChain)

    def own(chain: type) -> dict[str, object]:
        """The chain's own methods, its mixed-in parts' included (not ChainCore's)."""
        parts = [k for k in chain.__mro__ if k is chain or k not in ChainCore.__mro__]
        return {name: v for k in parts for name, v in vars(k).items()}

    wrong = {}
    for hook, row in HOOKS.items():
        defined = [c.__name__ for c in chains if callable(own(c).get(hook))]
        if defined != [_chain_of(row.process).__name__]:
            wrong[hook] = (str(row.process), defined)
    assert wrong == {}
    for hook, row in HOOKS.items():
        # A side's own hooks are not the other side's (as in vLLM's connectors).
        assert hasattr(SchedulerChain, hook) == (row.process is not Process.WORKER), hook
        assert hasattr(WorkerChain, hook) == (row.process is not Process.SCHEDULER), hook
