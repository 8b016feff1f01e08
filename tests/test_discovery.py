"""Plugin discovery through real entry points of a distribution made on the fly."""

from __future__ import annotations

import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pluggy
import pytest

from composer import PluginType, discover, hookimpl
from composer.cli import main
from composer.discovery import (
    ALLOW_ENV,
    DENY_ENV,
    ENTRY_POINT_GROUP,
    PluginConflict,
    PluginLoadError,
)


def _install(site: Path, dist: str, version: str, entry_points: dict[str, str]) -> None:
    """A minimal installed distribution: importlib.metadata finds it on sys.path."""
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = [f"[{ENTRY_POINT_GROUP}]", *(f"{k} = {v}" for k, v in entry_points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.delenv(DENY_ENV, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "kvc_fake_tiers.py").write_text(
        textwrap.dedent(
            """\
            from composer import PluginType, hookimpl

            @hookimpl
            def register_plugin_types(register):
                register(PluginType(name="fake-disk", node="kvc_fake_tiers.runtime:Disk"))
                register(PluginType(name="fake-ram", node="kvc_fake_tiers.runtime:Ram"))
            """
        )
    )
    (tmp_path / "kvc_fake_broken.py").write_text("import no_such_module_anywhere\n")
    (tmp_path / "kvc_fake_typo.py").write_text(
        textwrap.dedent(
            """\
            from composer import hookimpl

            @hookimpl
            def register_plugin_type(register):
                pass
            """
        )
    )
    _install(tmp_path, "kvc-fake-tiers", "1.2.3", {"fake-tiers": "kvc_fake_tiers"})
    yield tmp_path
    for name in ("kvc_fake_tiers", "kvc_fake_broken", "kvc_fake_typo"):
        sys.modules.pop(name, None)


def test_entry_point_plugins_are_found_with_their_distribution(site: Path) -> None:
    registry = discover()
    assert {"fake-disk", "fake-ram", "vllm"} <= set(registry.names())
    disk = registry["fake-disk"]
    assert (disk.package, disk.version) == ("kvc-fake-tiers", "1.2.3")
    assert registry["vllm"].package == "kv-composer"


@pytest.mark.parametrize("name", ["fake-tiers", "kvc-fake-tiers"])
def test_deny_by_entry_point_or_distribution_name(
    site: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv(DENY_ENV, f" other , {name} ")
    assert "fake-disk" not in discover()
    # An explicit argument adds to the environment's list.
    monkeypatch.delenv(DENY_ENV)
    assert "fake-disk" not in discover(deny=[name])


def test_allow_list_keeps_only_named_plugins_and_builtins(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALLOW_ENV, "kvc-fake-tiers")
    assert discover().names() == ["fake-disk", "fake-ram", "vllm"]
    monkeypatch.setenv(ALLOW_ENV, "something-else")
    assert discover().names() == ["vllm"]
    assert discover(allow=["fake-tiers"]).names() == ["fake-disk", "fake-ram", "vllm"]


def test_extra_objects_register_types(site: Path) -> None:
    class Extra:
        @hookimpl
        def register_plugin_types(self, register: Callable[[PluginType], None]) -> None:
            register(PluginType(name="extra", node="x:Y"))

    registry = discover(extra=[Extra()], entry_points=False)
    assert registry.names() == ["extra", "vllm"]
    assert registry["extra"].package == ""


def test_two_registrations_of_one_name_conflict(site: Path) -> None:
    module = types.ModuleType("kvc_second_disk")

    @hookimpl
    def register_plugin_types(register: Callable[[PluginType], None]) -> None:
        register(PluginType(name="fake-disk", node="x:Y"))

    module.register_plugin_types = register_plugin_types  # type: ignore[attr-defined]
    with pytest.raises(PluginConflict, match='plugin type "fake-disk" is registered twice'):
        discover(extra=[module])


def test_misspelled_discovery_hook_is_caught_by_check_pending(site: Path) -> None:
    _install(site, "kvc-fake-typo", "0.1", {"fake-typo": "kvc_fake_typo"})
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'register_plugin_type'"):
        discover()


def test_broken_plugin_package_names_itself_and_the_way_out(site: Path) -> None:
    _install(site, "kvc-fake-broken", "0.1", {"fake-broken": "kvc_fake_broken"})
    with pytest.raises(PluginLoadError) as info:
        discover()
    assert str(info.value) == (
        'plugin entry point "fake-broken" (kvc_fake_broken, from kvc-fake-broken) failed to '
        "import: ModuleNotFoundError: No module named 'no_such_module_anywhere'; disable it "
        "with KV_COMPOSER_DISABLE_PLUGINS=fake-broken"
    )
    # Denying it is the way out.
    assert "fake-disk" in discover(deny=["fake-broken"])


def test_cli_reports_a_broken_plugin_without_a_traceback(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _install(site, "kvc-fake-broken", "0.1", {"fake-broken": "kvc_fake_broken"})
    assert main(["plugins"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith('kvc: error: plugin entry point "fake-broken"')
    assert "Traceback" not in err


def test_cli_lists_entry_point_plugins(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "fake-disk  (kvc-fake-tiers 1.2.3)\n" in out
    assert "  config: (no options)\n" in out


def test_a_registry_walks_its_plugin_types_in_name_order(site: Path) -> None:
    registry = discover()
    assert [p.name for p in registry] == registry.names()
    assert all(isinstance(p, PluginType) for p in registry)
    assert len(registry) == len(registry.names())


@pytest.mark.parametrize("how", ["deny env", "deny argument", "allow env"])
def test_a_plugin_switched_off_is_named_as_such_not_as_unknown(
    site: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    from composer import PipelineInvalid, load_pipeline

    if how == "deny env":
        monkeypatch.setenv(DENY_ENV, "fake-tiers")
        registry, why = discover(), f"{DENY_ENV}=fake-tiers"
    elif how == "deny argument":
        registry, why = discover(deny=["kvc-fake-tiers"]), "deny="
    else:
        monkeypatch.setenv(ALLOW_ENV, "other")
        registry, why = discover(), f"{ALLOW_ENV}=other (not listed)"
    assert registry.switched_off["fake-tiers"] == why
    assert registry.why_unknown("fake-tiers") == (
        f'plugin "fake-tiers" is installed but switched off by {why}'
    )
    with pytest.raises(PipelineInvalid) as caught:
        load_pipeline({"version": 1, "nodes": {"a": {"plugin": "fake-disk"}}}, registry=registry)
    assert (
        f'unknown plugin "fake-disk"; plugin packages switched off, whose types are not '
        f'known: "fake-tiers" ({why})'
    ) in str(caught.value)
