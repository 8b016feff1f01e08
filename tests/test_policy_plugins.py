"""Cache policies for the people who write them: options declared by the policy and
validated as a node's config is, policies listed as plugins are (``kvc plugins``,
``kvc schema``, ``kvc graph``), a broken policy package kept to the pipelines that name
it, ``kvc validate --deep``'s method checks, and docs/cache-policies.md's walkthrough
(package, entry point, hook, install, validate, sweep) run as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from kvc_offload_cpu.config import OffloadCPUConfig
from kvc_offload_cpu.index import BlockIndex

from composer import PipelineInvalid, discover, find_policy, load_pipeline, policy_options
from composer import discovery as discovery_module
from composer.builtin_policies import BUILTIN
from composer.cli import main
from composer.cli.validating import schema_json
from composer.discovery import ALLOW_ENV, DENY_ENV, ENTRY_POINT_GROUP, MODULES_ENV
from composer.policy import (
    KINDS,
    SPECS,
    AdmissionPolicy,
    EvictionPolicy,
    RetentionPolicy,
    method_problems,
    misnamed_methods,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "cache-policies.md"
TRACE = ROOT / "tests" / "data" / "traces" / "mooncake-conversation_trace-500.jsonl"
#: What a tier's config names when it names nothing.
DEFAULTS = {"eviction": "lru", "admission": "threshold", "retention": "request"}

#: A policy of each kind with options (``mine_<kind>``), and for each kind a class
#: that is no policy (``notpolicy_<kind>``) and an instance registered instead of
#: its class (``instance_<kind>``): the module named in KV_COMPOSER_PLUGIN_MODULES.
POLICIES = '''
from pydantic import BaseModel, ConfigDict, Field

from composer import (
    AdmissionPolicy, CachePolicy, EvictionPolicy, RetentionPolicy, hookimpl, policy_options,
)


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_count: int = Field(default=15, ge=1, description="how far it counts")


class Required(BaseModel):
    level: int


class MineEviction(EvictionPolicy):
    def __init__(self, slots, config=None):
        super().__init__(slots, config)
        self.options = policy_options(config, "eviction", Options)
        self.order = {}

    def added(self, block):
        self.order[block.key] = block

    def victims(self):
        return iter(self.order.values())

    def removed(self, block, evicted):
        self.order.pop(block.key, None)


class MineAdmission(AdmissionPolicy):
    def __init__(self, slots, config=None):
        super().__init__(slots, config)
        self.options = policy_options(config, "admission", Options)

    def admit(self, keys):
        return len(keys)


class MineRetention(RetentionPolicy):
    def __init__(self, slots, config=None):
        super().__init__(slots, config)
        self.options = policy_options(config, "retention", Options)

    def requested(self, block, retention, now):
        return True

    def kept(self, block, now):
        return False


class Touchy(MineEviction):
    """Means to count hits, but the spec's method is touched: never called."""

    def touch(self, block):
        pass


class NotAPolicy:
    pass


MINE = {"eviction": MineEviction, "admission": MineAdmission, "retention": MineRetention}


@hookimpl
def register_cache_policies(register):
    for kind, cls in MINE.items():
        register(CachePolicy(f"mine_{kind}", kind, cls, f"a test {kind} policy", Options))
        register(CachePolicy(f"notpolicy_{kind}", kind, NotAPolicy))
        register(CachePolicy(f"instance_{kind}", kind, cls(4)))
    register(CachePolicy("needs_level", "eviction", MineEviction, options=Required))
    register(CachePolicy("touchy", "eviction", Touchy, "counts nothing"))
'''


@pytest.fixture(autouse=True)
def fresh_discovery(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every installed plugin, and find_policy's cache (keyed on the variables only)
    cleared around each test: tests here install packages on sys.path."""
    for var in (ALLOW_ENV, DENY_ENV, MODULES_ENV):
        monkeypatch.delenv(var, raising=False)
    discovery_module._installed.cache_clear()
    yield
    discovery_module._installed.cache_clear()


@pytest.fixture
def mine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test policies, importable and named in KV_COMPOSER_PLUGIN_MODULES; the
    working directory is ``tmp_path``."""
    (tmp_path / "kvc_test_policies.py").write_text(POLICIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(MODULES_ENV, "kvc_test_policies")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("kvc_test_policies", None)


def _write(config: str, name: str = "p.yaml") -> Path:
    """A one-node offload-cpu pipeline with ``config`` (YAML lines) under its config."""
    path = Path(name)
    lines = "".join(f"      {line}\n" for line in config.strip().splitlines())
    path.write_text(
        f"version: 1\nnodes:\n  cpu:\n    plugin: offload-cpu\n    config:\n"
        f"      capacity: 1MiB\n{lines}"
    )
    return path


def _at(path: Path, token: str) -> str:
    """``file:line:column`` of the first ``token`` in ``path`` (where an error is located)."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if token in line:
            return f"{path}:{number}:{line.index(token) + 1}"
    raise AssertionError(f"{token!r} not in {path}")


def _validate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["validate", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


def _other(kind: str) -> str:
    return KINDS[(KINDS.index(kind) + 1) % len(KINDS)]


def _module_way_out() -> str:
    return (
        f'from module "kvc_test_policies" ({MODULES_ENV}) cannot be used: {{}}; fix module '
        f'"kvc_test_policies", or take "kvc_test_policies" out of {MODULES_ENV}'
    )


# --------------------------------------------------------------------------- #
# Options, and every bad input, through the real `kvc validate`
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", KINDS)
def test_options_reach_the_policy_validated(
    mine: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(f"{kind}: mine_{kind}\n{kind}_options: {{max_count: 3}}")
    assert _validate(capsys, str(path)) == (
        0,
        "p.yaml: ok (1 node: cpu; runs as ComposedConnector)\n",
    )
    config = load_pipeline(path).nodes[0].config
    assert find_policy(kind, f"mine_{kind}")(64, config).options.max_count == 3
    # Without options (and without a config, as in a unit test): every default.
    default = _write(f"{kind}: mine_{kind}", "default.yaml")
    config = load_pipeline(default).nodes[0].config
    assert find_policy(kind, f"mine_{kind}")(64, config).options.max_count == 15
    assert find_policy(kind, f"mine_{kind}")(64).options.max_count == 15


def test_the_tier_builds_its_policy_with_the_options(mine: Path) -> None:
    config = OffloadCPUConfig(eviction="mine_eviction", eviction_options={"max_count": 7})
    index = BlockIndex(4, config.eviction, config)
    assert index.policy.options.max_count == 7


def _bad_inputs(kind: str) -> list[tuple[str, str, str]]:
    """(config lines, where the error is located, the message) for each bad input."""
    other, spec = _other(kind), SPECS[kind].__name__  # type: ignore[index]
    cls = f"Mine{kind.capitalize()}"
    options = f"nodes.cpu.config.{kind}_options"
    return [
        (  # options of the wrong type
            f"{kind}: mine_{kind}\n{kind}_options: {{max_count: many}}",
            "many",
            f'{options}.max_count: expected an integer, got "many"',
        ),
        (  # an option out of range
            f"{kind}: mine_{kind}\n{kind}_options: {{max_count: 0}}",
            "0}",
            f"{options}.max_count: input should be greater than or equal to 1 (got 0)",
        ),
        (  # an unknown option key, with did-you-mean
            f"{kind}: mine_{kind}\n{kind}_options: {{max_cont: 3}}",
            "max_cont",
            f'{options}.max_cont: unknown key "max_cont" (did you mean "max_count"?); '
            f'the {kind} policy "mine_{kind}" takes: "max_count"',
        ),
        (  # options that are no mapping
            f"{kind}: mine_{kind}\n{kind}_options: 3",
            "3",
            f"{options}: expected a mapping, got 3",
        ),
        (  # options for the built-in, which takes none
            f"{kind}_options: {{max_count: 3}}",
            "max_count",
            f'{options}.max_count: unknown key "max_count": the {kind} policy '
            f'"{DEFAULTS[kind]}" takes no options',
        ),
        (  # a policy name of another kind
            f"{kind}: mine_{other}",
            f"mine_{other}",
            f'nodes.cpu.config.{kind}: "mine_{other}" is {"an" if other[0] in "ae" else "a"} '
            f"{other} policy",
        ),
        (  # a name close to one installed
            f"{kind}: mine_{kind}s",
            f"mine_{kind}s",
            f'nodes.cpu.config.{kind}: unknown {kind} policy "mine_{kind}s" '
            f'(did you mean "mine_{kind}"?)',
        ),
        (  # a class that is not a policy
            f"{kind}: notpolicy_{kind}",
            f"notpolicy_{kind}",
            f'nodes.cpu.config.{kind}: {kind} policy "notpolicy_{kind}" '
            + _module_way_out().format(f"its class must subclass {spec}, got class NotAPolicy"),
        ),
        (  # an instance instead of a class
            f"{kind}: instance_{kind}",
            f"instance_{kind}",
            f'nodes.cpu.config.{kind}: {kind} policy "instance_{kind}" '
            + _module_way_out().format(
                f"registers an instance of {cls}; register the class, {cls}"
            ),
        ),
    ]


@pytest.mark.parametrize(
    ("kind", "case"), [(kind, case) for kind in KINDS for case in range(len(_bad_inputs(kind)))]
)
def test_every_bad_input_is_a_located_error(
    mine: Path, kind: str, case: int, capsys: pytest.CaptureFixture[str]
) -> None:
    config, token, message = _bad_inputs(kind)[case]
    path = _write(config)
    code, out = _validate(capsys, str(path))
    assert code == 2, out
    assert f"{_at(path, token)}: {message}" in out, out


def test_a_required_option_left_out_is_located_at_the_config(
    mine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write("eviction: needs_level")
    code, out = _validate(capsys, str(path))
    assert code == 2
    assert f'{_at(path, "capacity")[:-2]}' in out  # (at the config: no options given)
    assert 'nodes.cpu.config.eviction_options: missing required key "level"' in out


def test_every_problem_of_a_file_is_reported_at_once(
    mine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        "eviction: mine_eviction\neviction_options: {max_count: x, other: 1}\n"
        "admission: lur\nretention_options: {a: 1}"
    )
    code, out = _validate(capsys, str(path))
    assert code == 2 and out.endswith("4 problems in 1 file\n"), out


# --------------------------------------------------------------------------- #
# Listed as plugins are: kvc plugins, kvc schema, kvc graph
# --------------------------------------------------------------------------- #


def test_kvc_plugins_lists_every_policy_with_kind_package_description_and_options(
    mine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for policy in BUILTIN:
        row = rf"^  {policy.name} +{policy.kind} +\(kv-composer[^)]*\)  "
        assert re.search(row + re.escape(policy.description) + "$", out, re.M), policy.name
    assert re.search(r"^  mine_eviction +eviction +\(unknown package\)  a test eviction", out, re.M)
    assert "max_count  int, default 15  how far it counts\n" in out
    assert "cache policies that cannot be used (a pipeline naming one is refused):\n" in out
    assert 'eviction policy "notpolicy_eviction" from module "kvc_test_policies"' in out

    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {t["name"] for t in data["plugin_types"]} >= {"vllm", "offload-cpu"}
    policies = {p["name"]: p for p in data["cache_policies"]}
    assert policies["lru"] == {
        "name": "lru",
        "kind": "eviction",
        "package": "kv-composer",
        "version": policies["lru"]["version"],
        "description": "the least recently used block goes first",
        "class": "composer.builtin_policies:Lru",
        "options": {},
    }
    assert policies["mine_admission"]["options"] == {
        "max_count": {
            "type": "int", "default": 15, "required": False, "description": "how far it counts"
        }
    }
    broken = {b["name"]: b for b in data["broken_cache_policies"]}
    assert set(broken) >= {f"{what}_{kind}" for what in ("notpolicy", "instance") for kind in KINDS}
    assert broken["instance_retention"]["kind"] == "retention"
    assert "take \"kvc_test_policies\" out of" in broken["instance_retention"]["way_out"]


def test_kvc_schema_gives_the_installed_names_and_each_ones_options(mine: Path) -> None:
    schema = json.loads(schema_json(discover()))
    config = schema["$defs"]["OffloadCPUConfig"]
    assert config["properties"]["eviction"]["enum"] == [
        "arc", "lru", "mine_eviction", "needs_level", "touchy"
    ]
    assert config["properties"]["admission"]["enum"] == ["mine_admission", "threshold"]
    validator = jsonschema.Draft202012Validator(schema)

    def errors(config: dict[str, Any]) -> list[str]:
        data = {"version": 1, "nodes": {"cpu": {"plugin": "offload-cpu", "config": config}}}
        return [e.message for e in validator.iter_errors(data)]

    assert errors({}) == []
    assert errors({"eviction": "mine_eviction", "eviction_options": {"max_count": 3}}) == []
    assert errors({"admission": "mine_admission", "admission_options": {"max_count": 3}}) == []
    for bad in (
        {"eviction": "nope"},
        {"eviction": "mine_eviction", "eviction_options": {"max_count": "x"}},
        {"eviction": "mine_eviction", "eviction_options": {"max_cont": 3}},
        {"eviction_options": {"max_count": 3}},  # lru (the default) takes none
        {"retention": "mine_retention", "retention_options": {"max_count": 0}},
        {"eviction": "needs_level"},  # its options are required
    ):
        assert errors(bad), bad


def test_the_checked_in_schema_allows_the_built_in_names(root: Path) -> None:
    schema = json.loads((root / "schemas/pipeline.schema.json").read_text())
    config = schema["$defs"]["OffloadCPUConfig"]["properties"]
    assert config["eviction"]["enum"] == ["arc", "lru"]
    assert config["admission"]["enum"] == ["threshold"]
    assert config["retention"]["enum"] == ["request"]


def test_kvc_graph_names_the_policies_each_node_runs(
    mine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write("eviction: mine_eviction\neviction_options: {max_count: 3}")
    assert main(["graph", str(path)]) == 0
    out = capsys.readouterr().out
    assert "policies: eviction mine_eviction (max_count=3), admission threshold, " \
        "retention request\n" in out
    assert main(["graph", str(path), "--json"]) == 0
    (node,) = json.loads(capsys.readouterr().out)["nodes"]
    assert node["policies"][0] == {
        "kind": "eviction",
        "config_key": "eviction",
        "name": "mine_eviction",
        "package": "",
        "options": {"max_count": 3},
    }
    assert [p["name"] for p in node["policies"]] == ["mine_eviction", "threshold", "request"]
    assert main(["graph", str(path), "--format", "mermaid"]) == 0
    assert "eviction: mine_eviction" in capsys.readouterr().out


# --------------------------------------------------------------------------- #
# A broken policy package: isolated, and named where a pipeline uses it
# --------------------------------------------------------------------------- #


BROKEN = '''
from composer import CachePolicy, EvictionPolicy, hookimpl


class Lfu(EvictionPolicy):
    def added(self, block):
        pass

    def removed(self, block):
        pass


@hookimpl
def register_cache_policies(register):
    register(CachePolicy("lfu", "eviction", Lfu, "least frequently used"))
'''


def _install(site: Path, dist: str, module: str, source: str) -> None:
    """A package installed as pip would leave it: its module, and a distribution whose
    ``kv_composer`` entry point names it (importlib.metadata finds it on sys.path)."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{module} = {module}\n")


@contextmanager
def _installed(
    site: Path, monkeypatch: pytest.MonkeyPatch, dist: str, module: str, source: str
) -> Iterator[Path]:
    """:func:`_install`'d on ``sys.path``, ``site`` the working directory; its module
    forgotten after."""
    _install(site, dist, module, source)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(site)
    try:
        yield site
    finally:
        sys.modules.pop(module, None)


@pytest.fixture
def broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """kvc-broken-lfu installed: its policy lacks victims and its removed() cannot
    take the tier's call."""
    with _installed(tmp_path, monkeypatch, "kvc-broken-lfu", "kvc_broken_lfu", BROKEN):
        yield tmp_path


BROKEN_LFU = (
    'eviction policy "lfu" from kvc-broken-lfu 0.1.0 cannot be used: Lfu lacks victims; '
    "Lfu.removed(self, block) cannot take the tier's call removed(block, evicted): too many "
    "positional arguments; fix or upgrade kvc-broken-lfu, or switch kvc-broken-lfu off "
    f'with {DENY_ENV}=kvc-broken-lfu; eviction policies: "arc", "lru"'
)


def test_a_broken_policy_package_breaks_no_other_pipeline_or_command(
    broken: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = _write("eviction: arc", "plain.yaml")
    assert _validate(capsys, str(plain))[0] == 0
    for command in (["plugins"], ["plugins", "--json"], ["schema"], ["graph", str(plain)]):
        assert main(command) == 0, command
        capsys.readouterr()
    assert main(["plugins"]) == 0
    assert f"  {BROKEN_LFU.rpartition(';')[0]}\n" in capsys.readouterr().out


def test_the_pipeline_that_names_it_is_refused_where_it_names_it(
    broken: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write("eviction: lfu")
    code, out = _validate(capsys, str(path))
    assert (code, out) == (2, f"{_at(path, 'lfu')}: nodes.cpu.config.eviction: {BROKEN_LFU}\n"
                           "1 problem in 1 file\n")
    # A tier built by name (in vLLM's process, in the simulator) is refused the same way.
    with pytest.raises(LookupError, match=re.escape(BROKEN_LFU)):
        BlockIndex(4, "lfu")


def test_switched_off_it_is_gone(
    broken: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(DENY_ENV, "kvc-broken-lfu")
    assert main(["plugins"]) == 0
    assert "kvc-broken-lfu" not in capsys.readouterr().out
    code, out = _validate(capsys, str(_write("eviction: lfu")))
    assert code == 2 and 'unknown eviction policy "lfu"' in out


def test_a_hook_that_raises_is_named_when_a_pipeline_names_what_it_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = textwrap.dedent(
        """\
        from composer import hookimpl

        @hookimpl
        def register_cache_policies(register):
            raise RuntimeError("no licence file")
        """
    )
    with _installed(tmp_path, monkeypatch, "kvc-raising", "kvc_raising", source):
        assert _validate(capsys, str(_write("eviction: lru", "plain.yaml")))[0] == 0
        path = _write("eviction: lfu")
        code, out = _validate(capsys, str(path))
    assert code == 2
    assert (
        f'{_at(path, "lfu")}: nodes.cpu.config.eviction: unknown eviction policy "lfu" (did '
        'you mean "lru"?); '
        'eviction policies: "arc", "lru"; and a cache policy from kvc-raising 0.1.0 cannot be '
        "used: register_cache_policies raised RuntimeError: no licence file; fix or upgrade "
        f"kvc-raising, or switch kvc-raising off with {DENY_ENV}=kvc-raising\n"
    ) in out


OTHER_ARC = """
from composer import CachePolicy, EvictionPolicy, hookimpl


class Arc(EvictionPolicy):
    def added(self, block):
        pass

    def victims(self):
        return iter(())

    def removed(self, block, evicted):
        pass


@hookimpl
def register_cache_policies(register):
    register(CachePolicy("arc", "eviction", Arc, "another arc"))
"""


def test_a_name_two_packages_register_is_nobodys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with _installed(tmp_path, monkeypatch, "kvc-other-arc", "kvc_other_arc", OTHER_ARC):
        assert _validate(capsys, str(_write("eviction: lru", "plain.yaml")))[0] == 0
        path = _write("eviction: arc")
        code, out = _validate(capsys, str(path))
    assert code == 2
    assert re.search(
        rf'^{_at(path, "arc")}: nodes.cpu.config.eviction: eviction policy "arc" from '
        r"kv-composer [^ ]* ?and kvc-other-arc 0\.1\.0 cannot be used: registered 2 times; "
        rf"switch kvc-other-arc off with {DENY_ENV}=kvc-other-arc; eviction policies: "
        r'"lru"$',
        out,
        re.M,
    ), out


# --------------------------------------------------------------------------- #
# The policy's methods against its spec: at registration, and with --deep
# --------------------------------------------------------------------------- #


class _Good(EvictionPolicy):
    def __init__(self, slots: int, config: Any = None, *, extra: int = 0) -> None:
        super().__init__(slots, config)

    def added(self, block: Any) -> None: ...

    @staticmethod
    def touched(block: Any) -> None: ...

    def victims(self, *args: Any) -> Iterator[Any]:
        return iter(())

    def removed(self, block: Any, evicted: bool = False) -> None: ...


class _Bad(RetentionPolicy):
    def __init__(self, slots: int) -> None:
        super().__init__(slots)

    def requested(  # type: ignore[override]
        self, block: Any, retention: Any, now: float, *, why: str
    ) -> bool:
        return True

    kept = True  # type: ignore[assignment]

    def yields(self) -> Any:  # type: ignore[override]
        return None

    def removed(self, block: Any, evicted: bool) -> None:  # type: ignore[override]
        pass


def test_a_policy_whose_methods_take_the_tiers_calls_passes() -> None:
    assert method_problems(_Good, "eviction") == []
    assert misnamed_methods(_Good, "eviction") == []


def test_each_method_that_cannot_take_the_tiers_call_is_named() -> None:
    assert method_problems(_Bad, "retention") == [
        "_Bad.__init__(self, slots) cannot take the tier's call _Bad(slots, config): too "
        "many positional arguments",
        "_Bad.requested(self, block, retention, now, *, why) cannot take the tier's call "
        "requested(block, retention, now): missing a required argument: 'why'",
        "_Bad.kept is not a method (bool): the tier calls kept(block, now)",
        "_Bad.yields(self) cannot take the tier's call yields(kept, now): too many "
        "positional arguments",
        "_Bad.removed(self, block, evicted) cannot take the tier's call removed(block): "
        "missing a required argument: 'evicted'",
    ]


def test_kvc_validate_deep_checks_the_policys_methods_against_its_spec(
    mine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write("eviction: touchy")
    assert _validate(capsys, str(path))[0] == 0  # a guess: --deep's, not registration's
    code, out = _validate(capsys, "--deep", str(path))
    assert code == 2
    assert (
        f'{_at(path, "touchy")}: nodes.cpu.config.eviction: Touchy defines "touch" (did you '
        'mean "touched"?): the tier calls "touched", never "touch", so Touchy runs with the '
        "spec's default\n"
    ) in out
    assert _validate(capsys, "--deep", str(_write("eviction: mine_eviction", "ok.yaml")))[0] == 0


def test_policy_options_without_a_config_are_the_defaults() -> None:
    from pydantic import BaseModel

    class Options(BaseModel):
        depth: int = 2

    assert policy_options(None, "eviction", Options).depth == 2
    assert policy_options(OffloadCPUConfig(), "eviction", Options).depth == 2
    given = type("Config", (), {"admission_options": {"depth": 5}})()
    assert policy_options(given, "admission", Options).depth == 5


# --------------------------------------------------------------------------- #
# The author's page
# --------------------------------------------------------------------------- #


def test_the_docs_name_every_built_in_policy() -> None:
    text = DOCS.read_text()
    for policy in BUILTIN:
        assert f"`{policy.name}`" in text, policy.name
    assert {p.kind for p in BUILTIN} == set(KINDS)
    for spec in (EvictionPolicy, AdmissionPolicy, RetentionPolicy):
        assert f"`composer.{spec.__name__}`" in text


def _docs_blocks() -> dict[str, str]:
    """The page's fenced blocks that start with a comment naming their file
    (``# kvc-lfu/kvc_lfu.py``), by that name; and its text blocks, by their order
    (``text-0``, ...)."""
    blocks: dict[str, str] = {}
    texts = 0
    fences = re.findall(r"^( *)```(\w*)\n(.*?)^\1```$", DOCS.read_text(), re.M | re.S)
    for _, lang, indented in fences:
        body = textwrap.dedent(indented)
        first = body.splitlines()[0] if body else ""
        if first.startswith("# ") and lang in ("toml", "python", "yaml"):
            blocks[first[2:].partition(" (")[0].strip()] = body  # ("# p.yaml (needs ...)")
        elif lang == "text":
            blocks[f"text-{texts}"] = body
            texts += 1
    return blocks


def _text_block(blocks: dict[str, str], containing: str) -> str:
    found = [b for k, b in blocks.items() if k.startswith("text-") and containing in b]
    assert len(found) == 1, containing
    return found[0]


def _install_the_walkthrough(
    blocks: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> Path:
    """The page's package (with ``source`` as its module) ``pip install``ed as the page
    says (into a directory of its own, offline), on the path; its p.yaml. The working
    directory is ``tmp_path``."""
    project, site = tmp_path / "kvc-lfu", tmp_path / "site"
    project.mkdir()
    (project / "pyproject.toml").write_text(blocks["kvc-lfu/pyproject.toml"])
    (project / "kvc_lfu.py").write_text(source)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(site), str(project)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    assert list(site.glob("kvc_lfu-0.1.0.dist-info"))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(tmp_path)
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(blocks["p.yaml"])
    return pipeline


def test_the_walkthrough_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cache-policies.md's package, installed, listed, validated, drawn and swept."""
    blocks = _docs_blocks()
    source = blocks["kvc-lfu/kvc_lfu.py"]
    pipeline = _install_the_walkthrough(blocks, tmp_path, monkeypatch, source)
    try:
        _walk_through(blocks, pipeline, tmp_path, capsys)
    finally:
        sys.modules.pop("kvc_lfu", None)


def test_the_pages_broken_package_is_refused_as_it_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The page's example of a policy that cannot be used: its package with a removed()
    that forgets ``evicted``."""
    blocks = _docs_blocks()
    source = blocks["kvc-lfu/kvc_lfu.py"]
    wrong = source.replace(
        "def removed(self, block: Block, evicted: bool) -> None:",
        "def removed(self, block: Block) -> None:  # type: ignore[override]",
    )
    assert wrong != source
    _install_the_walkthrough(blocks, tmp_path, monkeypatch, wrong)
    try:
        code, out = _validate(capsys, "p.yaml")
    finally:
        sys.modules.pop("kvc_lfu", None)
    shown = _text_block(blocks, "cannot be used:")
    assert (code, out) == (2, shown.strip() + "\n1 problem in 1 file\n")


def _walk_through(
    blocks: dict[str, str], pipeline: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # kvc plugins: the lines shown for lfu (the built-ins' carry this install's version).
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    shown = _text_block(blocks, "cache policies (")
    for line in shown.splitlines():
        if "kv-composer" not in line:
            assert f"{line}\n" in out, line

    # kvc validate --deep, kvc graph: as shown.
    shown = _text_block(blocks, "$ kvc validate --deep p.yaml")
    assert _validate(capsys, "--deep", "p.yaml") == (0, shown.splitlines()[1] + "\n")
    assert main(["graph", "p.yaml"]) == 0
    graph = capsys.readouterr().out
    for line in shown.split("...\n")[1].splitlines():
        assert f"{line}\n" in graph, line

    # The three mistakes, as the page describes them.
    errors = _text_block(blocks, "expected an integer").splitlines()
    good = pipeline.read_text()
    mistakes = [
        good.replace("{max_count: 4}", "{max_count: lots}"),
        good.replace("{max_count: 4}", "{max_cuont: 4}"),
        good.replace("eviction: lfu", "eviction: lru"),
    ]
    for text, line in zip(mistakes, errors, strict=True):
        pipeline.write_text(text)
        assert _validate(capsys, "p.yaml") == (2, f"{line}\n1 problem in 1 file\n")
    pipeline.write_text(good)

    # The policy itself, in the tier's index: a block served once outlives one never served.
    config = load_pipeline(pipeline).nodes[0].config
    index = BlockIndex(2, "lfu", config)
    assert index.policy.max_count == 4
    a, b = index.allocate(b"a"), index.allocate(b"b")
    assert a is not None and b is not None
    index.mark_ready(a)
    index.mark_ready(b)
    index.touch(a)
    assert index.allocate(b"c") is not None and b"a" in index and b"b" not in index

    # The sweep against the built-ins: the table shown.
    shown = _text_block(blocks, "fraction of prompt tokens served")
    command = re.search(r"kvc simulate (.*?)\n\n?```", DOCS.read_text(), re.S)
    assert command is not None
    args = command[1].replace("\\\n", " ").split()
    args = [str(TRACE) if a.endswith(".jsonl") else a for a in args]
    args = [str(tmp_path / "lfu.txt") if a == "lfu.txt" else a for a in args]
    assert main(["simulate", *args]) == 0
    capsys.readouterr()
    table = (tmp_path / "lfu.txt").read_text()
    assert [line.split() for line in table.splitlines()] == [
        line.split() for line in shown.splitlines()
    ]


def test_a_walkthrough_pipeline_is_refused_without_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(_docs_blocks()["p.yaml"])
    with pytest.raises(PipelineInvalid, match='unknown eviction policy "lfu"'):
        load_pipeline("p.yaml")
