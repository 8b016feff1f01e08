"""``kvc``: every command in-process, plus the installed console script as a user runs it."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import textwrap
from pathlib import Path

import pytest

from composer.cli import main, running
from composer.cli.showing import mermaid_text
from composer.loader import MAX_FILE_BYTES
from composer.pipeline import SCHEMA_ID

NATIVE = """\
version: 1
nodes:
  nixl:
    plugin: vllm
    config: {connector: NixlConnector}
  disk:
    plugin: vllm
    config:
      connector: ExampleConnector
      extra_config: {shared_storage_path: kv-store}
"""

COMPOSED = """\
version: 1
load_policy: longest_hit
nodes:
  disk:
    plugin: vllm
    on_error: recompute
    config: {connector: ExampleConnector}
  nixl:
    plugin: vllm
    role: transport
    config: {connector: NixlConnector}
  spare:
    plugin: vllm
    enabled: false
    config: {connector: LMCacheConnectorV1}
load_order: [nixl, disk]
save_to: [disk]
"""

BAD = """\
version: 1
nodes:
  nixl:
    plugin: vlm
  disk:
    plugin: vllm
    needs: [nixl, dsk]
    config: {connector: ExampleConnector}
"""


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for name, text in {"native.yaml": NATIVE, "composed.yaml": COMPOSED, "bad.yaml": BAD}.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


BAD_LINES = [
    'bad.yaml:4:13: nodes.nixl.plugin: unknown plugin "vlm" (did you mean "vllm"?); '
    'installed: "vllm"',
    'bad.yaml:7:19: nodes.disk.needs[1]: node "dsk" does not exist (did you mean "disk"?); '
    'nodes: "disk", "nixl"',
]


@pytest.fixture(autouse=True)
def only_builtin_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    # Messages list the installed plugins: keep them independent of what this venv has.
    monkeypatch.setenv("KV_COMPOSER_PLUGINS", "none-at-all")
    monkeypatch.delenv("KV_COMPOSER_DISABLE_PLUGINS", raising=False)


# --------------------------------------------------------------------------- #
# validate
# --------------------------------------------------------------------------- #


def test_validate_ok(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "validate", "native.yaml", "composed.yaml") == (
        0,
        "native.yaml: ok (2 nodes: nixl, disk; runs as MultiConnector)\n"
        "composed.yaml: ok (2 nodes: disk, nixl; runs as ComposedConnector)\n",
        "",
    )


def test_validate_reports_every_problem_of_every_file(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (files / "syntax.yaml").write_text("version: 1\nnodes: [\n")
    (files / "latin1.yaml").write_bytes(b"version: 1 # caf\xe9\n")
    code, out, err = run(
        capsys, "validate", "native.yaml", "bad.yaml", "syntax.yaml", "latin1.yaml", "nope.yaml"
    )
    assert code == 2
    assert out.splitlines() == [
        "native.yaml: ok (2 nodes: nixl, disk; runs as MultiConnector)",
        *BAD_LINES,
        "syntax.yaml:3:1: <root>: YAML syntax error: did not find expected node content "
        "(while parsing a flow node)",
        "latin1.yaml:1:17: <root>: pipeline file is not UTF-8 text: byte 0xe9 cannot be decoded",
        "nope.yaml: <root>: cannot read pipeline file: No such file or directory",
    ]
    assert err == "5 problems in 4 files\n"


def test_validate_json(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "validate", "--json", "native.yaml", "bad.yaml")
    assert code == 2
    assert json.loads(out) == {
        "ok": False,
        "files": [
            {
                "file": "native.yaml",
                "ok": True,
                "problems": [],
                "nodes": ["nixl", "disk"],
                "runs_as": "MultiConnector",
            },
            {
                "file": "bad.yaml",
                "ok": False,
                "problems": [
                    {
                        "file": "bad.yaml",
                        "line": 4,
                        "column": 13,
                        "path": "nodes.nixl.plugin",
                        "message": BAD_LINES[0].split("nodes.nixl.plugin: ")[1],
                    },
                    {
                        "file": "bad.yaml",
                        "line": 7,
                        "column": 19,
                        "path": "nodes.disk.needs[1]",
                        "message": BAD_LINES[1].split("nodes.disk.needs[1]: ")[1],
                    },
                ],
                "nodes": [],
                "runs_as": None,
            },
        ],
    }
    # The global flag means the same.
    assert run(capsys, "--json", "validate", "native.yaml", "bad.yaml") == (code, out, "")


def test_validate_reads_stdin(
    files: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    def stdin(data: bytes) -> None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))

    stdin(b"version: 1\nnodes: {}\n")
    assert run(capsys, "validate", "-") == (
        2,
        "<stdin>:2:8: nodes: a pipeline needs at least one node\n",
        "1 problem in 1 file\n",
    )
    stdin(b"version: 1 # caf\xe9\n")
    assert run(capsys, "validate", "-") == (
        2,
        "<stdin>:1:17: <root>: input is not UTF-8 text: byte 0xe9 cannot be decoded\n",
        "1 problem in 1 file\n",
    )


def test_usage_errors_exit_2(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "validate")
    assert code == 2
    assert "the following arguments are required: FILE" in err
    code, _, err = run(capsys, "graph", "native.yaml", "--format", "svg")
    assert code == 2
    assert "argument --format: invalid choice: 'svg'" in err
    assert run(capsys)[0] == 2


# --------------------------------------------------------------------------- #
# deep check (vLLM's connector registry)
# --------------------------------------------------------------------------- #


def test_deep_check_reports_unknown_connectors_located(files: Path) -> None:
    from composer import load_pipeline
    from composer.loader import load_yaml
    from composer.validation.deep_check import deep_check

    text = NATIVE.replace("NixlConnector", "NixlConector") + (
        "  mine:\n"
        "    plugin: vllm\n"
        "    config: {connector: MyConnector, module_path: my_pkg.connector}\n"
    )
    (files / "deep.yaml").write_text(text)
    pipeline = load_pipeline("deep.yaml")
    _, marks, _ = load_yaml(text)
    problems = deep_check(
        pipeline, marks=marks, registered=["NixlConnector", "ExampleConnector", "MultiConnector"]
    )
    # ExampleConnector is registered; MyConnector loads from its module path.
    assert [str(p) for p in problems] == [
        'deep.yaml:5:25: nodes.nixl.config.connector: vLLM has no KV connector "NixlConector" '
        '(did you mean "NixlConnector"?); registered: "ExampleConnector", "MultiConnector", '
        '"NixlConnector" (set module_path for an out-of-tree connector)'
    ]
    # Without marks the problem still names the file and the key.
    assert str(deep_check(pipeline, registered=["ExampleConnector"])[0]).startswith(
        'deep.yaml: nodes.nixl.config.connector: vLLM has no KV connector "NixlConector"'
    )


def test_deep_check_locates_a_poll_wait_this_nixl_cannot_take(
    files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the installed NIXL: it takes the setting; one whose Python API makes its
    agents another way is reported at the setting, before launch."""
    import importlib

    from composer import load_pipeline
    from composer.builtin import NIXL_API
    from composer.loader import load_yaml
    from composer.validation.deep_check import deep_check

    text = NATIVE.replace("NixlConnector}", "NixlConnector, nixl_poll_ms: 1}")
    (files / "deep.yaml").write_text(text)
    pipeline = load_pipeline("deep.yaml")
    _, marks, _ = load_yaml(text)
    names = ["NixlConnector", "ExampleConnector"]
    assert deep_check(pipeline, marks=marks, registered=names, classes=False) == []
    monkeypatch.setattr(importlib.import_module(NIXL_API), "nixlBind", object())
    (problem,) = deep_check(pipeline, marks=marks, registered=names, classes=False)
    assert str(problem) == (
        "deep.yaml:5:54: nodes.nixl.config.nixl_poll_ms: this NIXL's nixl._api makes no "
        "agent through nixlBind.nixlAgent: it cannot be set"
    )


def test_validate_deep_against_the_installed_vllm(files: Path, kvc: str) -> None:
    """One real run: imports vLLM, so it is the slowest test here."""
    (files / "typo.yaml").write_text(NATIVE.replace("ExampleConnector", "ExampleConector"))
    proc = subprocess.run(
        [kvc, "validate", "--deep", "native.yaml", "typo.yaml"],
        capture_output=True,
        text=True,
        env={**os.environ, "KV_COMPOSER_PLUGINS": "none-at-all"},
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "native.yaml: ok (2 nodes: nixl, disk; runs as MultiConnector)"
    assert lines[1].startswith(
        'typo.yaml:9:18: nodes.disk.config.connector: vLLM has no KV connector "ExampleConector" '
        '(did you mean "ExampleConnector"?); registered: '
    )
    assert '"NixlConnector"' in lines[1]
    assert len(lines) == 2
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- #
# graph, plugins, schema, export
# --------------------------------------------------------------------------- #


def test_graph_text(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "graph", "composed.yaml")
    assert code == 0
    assert out == textwrap.dedent(
        """\
        pipeline composed.yaml
          kv_role kv_both, hma off, runs as ComposedConnector

        nodes (dependency order):
          disk  vllm (ExampleConnector)  role both, on_error recompute
          nixl  vllm (NixlConnector)     role transport
          disabled: spare

        load order (longest_hit): nixl -> disk
        save to: disk

        P/D sides (this engine: kv_both):
          disk  producer  serves prefixes it holds; saves the prompts it prefills
                consumer  serves prefixes it holds; saves what arrives and what decode adds
          nixl  producer  ships nothing (not in save_to)
                consumer  receives the prompt's KV from the prefill engine
        """
    )


def test_graph_mermaid_with_needs(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (files / "needs.yaml").write_text(NATIVE + "    needs: [nixl]\n" + "load_order: [disk, nixl]\n")
    code, out, _ = run(capsys, "graph", "--format", "mermaid", "needs.yaml")
    assert code == 0
    assert out == textwrap.dedent(
        """\
        flowchart LR
          n0["nixl<br/>vllm (NixlConnector)<br/>role: both"]
          n1["disk<br/>vllm (ExampleConnector)<br/>role: both"]
          n1 -. needs .-> n0
          load(["load: first_hit"])
          load -->|1| n1
          load -->|2| n0
          save(["save"])
          save --> n0
          save --> n1
        """
    )


def test_graph_json(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--json", "graph", "composed.yaml")
    assert code == 0
    data = json.loads(out)
    assert data["nodes"][1] == {
        "id": "nixl",
        "plugin": "vllm",
        "connector": "NixlConnector",
        "role": "transport",
        "needs": [],
        "on_error": "fail",
        "tiers": [],
        "policies": [],  # (a vllm node's config names no cache policy)
        "sides": {
            "producer": "ships nothing (not in save_to)",
            "consumer": "receives the prompt's KV from the prefill engine",
        },
    }
    assert data["load_order"] == ["nixl", "disk"]
    assert (data["save_to"], data["disabled"]) == (["disk"], ["spare"])


def test_graph_of_an_invalid_file_exits_2_with_problems_on_stderr(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "graph", "bad.yaml") == (2, "", "\n".join(BAD_LINES) + "\n")


def test_plugins(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plugins")
    assert code == 0
    assert out.startswith("vllm  (kv-composer ")
    assert "  roles: both, load, save, transport (default both)\n" in out
    assert "  capabilities: depends on the node's config\n" in out
    assert (
        "    connector         str, required  Name in vLLM's KVConnectorFactory, e.g. "
        "NixlConnector.\n" in out
    )
    assert "    kv_port           int | None, default null  TCP port, 1 to 65535.\n" in out

    assert "\ncache policies (" in out
    assert re.search(r"^  lru +eviction +\(kv-composer[^)]*\)  the least recently used", out, re.M)

    code, out, _ = run(capsys, "plugins", "--json")
    (vllm,) = json.loads(out)["plugin_types"]
    assert {p["name"] for p in json.loads(out)["cache_policies"]} >= {"lru", "arc", "threshold"}
    assert vllm["name"] == "vllm"
    assert vllm["package"] == "kv-composer"
    native = "composer.vllm.native:NativeConnectorNode"
    assert vllm["classes"] == {"scheduler": native, "worker": native}
    assert vllm["config"]["kv_role"] == {
        "type": "'kv_producer' | 'kv_consumer' | 'kv_both' | None",
        "default": None,
        "required": False,
        "description": "Defaults to the composed connector's kv_role.",
    }


def test_schema_prints_and_writes(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, printed, _ = run(capsys, "schema")
    assert code == 0
    schema = json.loads(printed)
    assert schema["$id"] == SCHEMA_ID
    assert schema["properties"]["nodes"]["minProperties"] == 1
    assert printed == json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    code, _, err = run(capsys, "schema", "--output", "out/schemas")
    assert (code, err) == (0, "wrote out/schemas/pipeline.schema.json\n")
    assert (files / "out/schemas/pipeline.schema.json").read_text() == printed


def test_export_plain_multiconnector(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "export", "native.yaml")
    assert code == 0
    assert json.loads(out) == {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": "kv-store"},
                },
            ]
        },
    }
    # One line, so that "$(kvc export ...)" is one shell word.
    assert out.count("\n") == 1


def test_export_composed_inline_and_by_reference(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "export", "composed.yaml")
    assert code == 0
    config = json.loads(out)
    assert config["kv_connector"] == "ComposedConnector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"]["pipeline"]["load_order"] == ["nixl", "disk"]

    code, out, _ = run(capsys, "export", "--reference", "composed.yaml")
    assert json.loads(out)["kv_connector_extra_config"] == {
        "pipeline": str(files / "composed.yaml"),
        "kv_role": "kv_both",
    }


def test_serve_and_demo_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "serve", "--help")
    assert code == 0
    assert out.startswith(
        "usage: kvc serve [-h] [--kv-role {producer,consumer,both}] [--valkey] FILE ..."
    )
    code, out, _ = run(capsys, "demo", "--help")
    assert code == 0
    assert out.startswith("usage: kvc demo [-h] [FILE]")


def test_serve_and_demo_hand_their_arguments_over(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, object, object]] = []
    monkeypatch.setattr(
        running,
        "serve",
        lambda file, args, valkey, kv_role: (
            calls.append(("serve" + "+valkey" * valkey + f"+{kv_role}" * bool(kv_role), file, args))
            or 0
        ),
    )
    monkeypatch.setattr(running, "demo_main", lambda file: calls.append(("demo", file, None)) or 3)
    assert main(["serve", "p.yaml", "--", "MODEL", "--port", "8000", "--", "x"]) == 0
    assert main(["serve", "p.yaml"]) == 0
    assert main(["serve", "--valkey", "p.yaml", "--", "MODEL"]) == 0
    assert main(["serve", "--kv-role", "consumer", "p.yaml", "--", "MODEL"]) == 0
    assert main(["demo"]) == 3
    assert main(["demo", "p.yaml"]) == 3
    assert calls == [
        ("serve", "p.yaml", ["MODEL", "--port", "8000", "--", "x"]),
        ("serve", "p.yaml", []),
        ("serve+valkey", "p.yaml", ["MODEL"]),
        ("serve+consumer", "p.yaml", ["MODEL"]),
        ("demo", None, None),
        ("demo", "p.yaml", None),
    ]


@pytest.mark.parametrize("missing", ["vllm", "torch", "torch.cuda"])
def test_serve_and_demo_without_vllm_or_torch_say_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], missing: str
) -> None:
    def absent(*args: object, **kwargs: object) -> int:
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setattr(running, "serve", absent)
    monkeypatch.setattr(running, "demo_main", absent)
    for command in (["serve", "p.yaml"], ["demo"]):
        code, _, err = run(capsys, *command)
        assert code == 1 and "Traceback" not in err
        assert err.startswith(f"kvc: error: kvc {command[0]} needs vLLM (No module named")
        assert "pip install 'kv-composer[vllm]'" in err


def test_the_demo_names_its_requests_for_what_they_are() -> None:
    from composer.cli.demo import demo_rounds

    def leading_words_shared(a: str, b: str) -> int:
        return len(os.path.commonprefix([a.split(), b.split()]))

    rounds = demo_rounds()
    names = [name for requests in rounds for name, _ in requests]
    assert len(set(names)) == len(names)
    first_time = {name.split(",")[0]: prompt for name, prompt in rounds[0]}
    assert all(name.endswith(", first time") for name, _ in rounds[0])
    for name, prompt in rounds[1]:
        if name.endswith(" again"):  # the same prompt as that letter's first time
            assert prompt == first_time[name.removesuffix(" again")]
        elif name.endswith(", first time"):  # no earlier prompt starts as it does
            assert all(leading_words_shared(prompt, p) < 5 for p in first_time.values())
        else:  # "X's start, new end": X's first words, then others
            start = first_time[name.split("'s start")[0]]
            assert 30 <= leading_words_shared(prompt, start) < len(start.split())


def test_serve_refuses_a_bad_pipeline_and_becomes_vllm_serve_for_a_good_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from composer.cli.serve import serve

    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nnodes:\n  a:\n    plugin: vlm\n")
    assert serve(str(bad), ["MODEL"]) == 2
    assert f"{bad}:4:13: nodes.a.plugin: unknown plugin" in capsys.readouterr().err

    class Exec(Exception):
        pass

    def fake_execv(path: str, argv: list[str]) -> None:
        raise Exec(path, argv)

    good = tmp_path / "good.yaml"
    # (A pipeline of vLLM connectors alone, asking for nothing more, is exported
    # as MultiConnector; annotate_outputs needs the composed connector.)
    good.write_text(
        "version: 1\nannotate_outputs: true\nnodes:\n"
        "  a:\n    plugin: vllm\n    config: {connector: ExampleConnector}\n"
    )
    monkeypatch.setattr(os, "execv", fake_execv)
    with pytest.raises(Exec) as replaced:
        serve(str(good), ["MODEL", "--port", "8000"])
    path, argv = replaced.value.args
    assert argv[0] == path and argv[1:5] == ["-m", "composer.vllm.cli", "serve", "MODEL"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "ComposedConnector"
    assert config["kv_connector_extra_config"]["pipeline"] == str(good.resolve())


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("validate", "graph", "plugins", "schema", "export", "serve", "demo"):
        assert f"\n    {command} " in out


# --------------------------------------------------------------------------- #
# the installed console script
# --------------------------------------------------------------------------- #


def test_console_script_exit_codes_and_no_tracebacks(files: Path, kvc: str) -> None:
    def kv(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kvc, *argv], capture_output=True, text=True, cwd=files)

    ok = kv("validate", "native.yaml")
    assert (ok.returncode, ok.stdout) == (
        0,
        "native.yaml: ok (2 nodes: nixl, disk; runs as MultiConnector)\n",
    )
    bad = kv("validate", "native.yaml", "bad.yaml", "missing.yaml")
    assert bad.returncode == 2
    assert bad.stdout.splitlines()[1:] == [
        *BAD_LINES,
        "missing.yaml: <root>: cannot read pipeline file: No such file or directory",
    ]
    assert "Traceback" not in bad.stderr
    as_json = kv("validate", "--json", "bad.yaml")
    assert as_json.returncode == 2
    assert [p["path"] for p in json.loads(as_json.stdout)["files"][0]["problems"]] == [
        "nodes.nixl.plugin",
        "nodes.disk.needs[1]",
    ]
    exported = kv("export", "bad.yaml")
    assert (exported.returncode, exported.stdout) == (2, "")
    assert exported.stderr.splitlines() == BAD_LINES


# --------------------------------------------------------------------------- #
# hostile input through the CLI
# --------------------------------------------------------------------------- #

_INJECTIONS = [
    '"]\n  click n0 call alert(1)\n  x["',
    "<img src=x onerror=alert(1)>",
    "%%{init: {'securityLevel': 'loose'}}%%",
    "a\\nb #quot; ]) --> n0",
    "\x1b[31m\u202e`ls`",
]


@pytest.mark.parametrize("name", _INJECTIONS)
def test_mermaid_labels_cannot_inject_statements_or_html(
    files: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    escaped = "".join(c if c.isascii() and c.isprintable() else f"\\U{ord(c):08x}" for c in name)
    escaped = escaped.replace("\\", "\\\\").replace('"', '\\"').replace("\\\\U", "\\U")
    (files / "inject.yaml").write_text(
        f'version: 1\nnodes:\n  n:\n    plugin: vllm\n    config: {{connector: "{escaped}"}}\n'
    )
    code, out, _ = run(capsys, "graph", "--format", "mermaid", "inject.yaml")
    assert code == 0
    lines = out.splitlines()
    label = mermaid_text(f"vllm ({name})")
    assert lines[:2] == ["flowchart LR", f'  n0["n<br/>{label}<br/>role: both"]']
    # Inside the label: only letters, digits, a little punctuation and entity codes.
    label = lines[1][len('  n0["') : -len('"]')]
    assert re.fullmatch(r"([A-Za-z0-9 _.,:()-]|#\d+;|<br/>)*", label), label
    assert len(lines) == 6  # the node, the load and save hubs and their edges: nothing added


def test_mermaid_text_round_trips_through_entity_codes() -> None:
    for text in _INJECTIONS:
        decoded = re.sub(r"#(\d+);", lambda m: chr(int(m.group(1))), mermaid_text(text))
        assert decoded == text


def test_graph_text_and_ok_lines_escape_user_text(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (files / "evil.yaml").write_text(
        "version: 1\nnodes:\n  n:\n    plugin: vllm\n"
        '    config: {connector: "X\\nfile.yaml:1:1: forged\\e[2J\\u202e"}\n'
    )
    code, out, _ = run(capsys, "graph", "evil.yaml")
    assert code == 0
    assert "  n  vllm (X\\nfile.yaml:1:1: forged\\x1b[2J\\u202e)  role both" in out.splitlines()
    assert "\x1b" not in out and "\u202e" not in out
    (files / "new\nline.yaml").write_text(NATIVE)
    code, out, _ = run(capsys, "validate", "new\nline.yaml")
    assert (code, out) == (0, "new\\nline.yaml: ok (2 nodes: nixl, disk; runs as MultiConnector)\n")


def _kvc_limited(
    kvc: str, *argv: str, cwd: Path, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (512 * 1024**2, 512 * 1024**2))

    # The timeout only keeps a regression (a hang) from stalling the suite.
    return subprocess.run(
        [kvc, *argv],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        timeout=60,
        preexec_fn=limit,
        env={**os.environ, **(env or {})},
    )


def test_non_regular_and_oversized_files_exit_2_without_reading(files: Path, kvc: str) -> None:
    os.mkfifo(files / "fifo.yaml")  # no writer: a blocking read would wait forever
    (files / "big.yaml").write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    done = _kvc_limited(
        kvc, "validate", "/dev/zero", "fifo.yaml", "big.yaml", ".", "native.yaml", cwd=files
    )
    assert done.returncode == 2
    assert done.stdout.decode().splitlines() == [
        "/dev/zero: <root>: cannot read pipeline file: not a regular file",
        "fifo.yaml: <root>: cannot read pipeline file: not a regular file",
        "big.yaml: <root>: pipeline file too large (1,048,577 bytes; at most 1,048,576 bytes "
        "are read)",
        ".: <root>: cannot read pipeline file: Is a directory",
        "native.yaml: ok (2 nodes: nixl, disk; runs as MultiConnector)",
    ]
    assert done.stderr.decode() == "4 problems in 4 files\n"


def test_oversized_stdin_exits_2(files: Path, kvc: str) -> None:
    done = _kvc_limited(kvc, "validate", "-", cwd=files, stdin=b"#" * (MAX_FILE_BYTES * 3))
    assert (done.returncode, done.stdout.decode()) == (
        2,
        "<stdin>: <root>: input too large (more; at most 1,048,576 bytes are read)\n",
    )


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("import sys\nsys.exit(0)\n", "failed to import: SystemExit(0)"),
        ("1/0\n", "failed to import: ZeroDivisionError"),
        (
            "from composer import PluginType, hookimpl\n"
            "@hookimpl\n"
            "def register_plugin_types(register):\n"
            "    register(PluginType(name='odd', node='x:Y', config=dict))\n",
            'plugin type "odd": config must be a pydantic model class',
        ),
        (
            "from pydantic import BaseModel\n"
            "from composer import PluginType, hookimpl\n"
            "class C(BaseModel):\n    pass\n"
            "def check(node_id, config, data):\n    raise RuntimeError('bug')\n"
            "@hookimpl\n"
            "def register_plugin_types(register):\n"
            "    register(PluginType(name='cache', node='x:Y', config=C, check=check))\n",
            'plugin "cache" failed while checking the pipeline: RuntimeError: bug',
        ),
    ],
    ids=["sys-exit-0", "raises", "config-not-a-model", "check-raises"],
)
def test_a_broken_plugin_module_is_an_environment_error_exit_1(
    files: Path, kvc: str, module: str, message: str
) -> None:
    (files / "kvc_hostile_plugin.py").write_text(module)
    (files / "p.yaml").write_text(
        "version: 1\nnodes:\n  c:\n    plugin: cache\n    config: {}\n  x:\n    plugin: nope\n"
    )
    done = _kvc_limited(
        kvc,
        "validate",
        "p.yaml",
        cwd=files,
        env={"KV_COMPOSER_PLUGIN_MODULES": "kvc_hostile_plugin", "PYTHONPATH": str(files)},
    )
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert err.startswith("kvc: error: ") and message in err and "Traceback" not in err
    assert done.stdout == b""


def test_validate_help_states_the_limits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "Limits (each reported where it is crossed): files of at most 1,048,576 bytes, regular "
        "files or stdin only; nesting at most 100 levels; at most 100,000 values once aliases "
        "are expanded; numbers of at most 100 characters." in text
    )


def test_a_terminal_that_cannot_show_a_name_gets_an_escape_not_a_crash(
    files: Path, kvc: str
) -> None:
    (files / "caf\u00e9.yaml").write_text('version: 1\nnodes:\n  n:\n    plugin: "\u4e2d"\n')
    done = _kvc_limited(
        kvc, "validate", "caf\u00e9.yaml", cwd=files, env={"PYTHONIOENCODING": "ascii"}
    )
    assert done.returncode == 2
    assert done.stdout.decode().startswith(
        'caf\\xe9.yaml:4:13: nodes.n.plugin: unknown plugin "\\u4e2d"'
    )
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--kv-events-config", "{}", "--prefix-caching-hash-algo", "xxhash"],
        ["--kv_events_config={}", "--prefix-caching-hash-algo=xxhash_cbor"],
    ],
)
def test_serve_refuses_kv_events_hashed_with_a_random_seed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    from composer.cli.serve import kv_events_problem, serve

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    example = str(Path(__file__).parents[1] / "examples" / "cpu-offload.yaml")
    # serve() itself (main() would configure logging onto capsys's stream, which
    # closes with this test: later tests' log lines would fail on it).
    assert serve(example, ["m", *args]) == 2
    assert "set PYTHONHASHSEED to the same value for every engine" in capsys.readouterr().err

    assert kv_events_problem(args, {"PYTHONHASHSEED": "0"}) == ""
    # sha256 (vLLM's default) has a fixed seed; no events, nothing to match.
    assert kv_events_problem(["m", "--kv-events-config", "{}"], {}) == ""
    assert kv_events_problem(["m", "--prefix-caching-hash-algo", "xxhash"], {}) == ""
