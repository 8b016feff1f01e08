"""Disaggregated prefill/decode as a pipeline shape: one file, the side from where it runs.

The rules (composer/validation/pd.py): a consumer needs a transport node that
loads, a producer one that saves; at most one transport per side unless
``sides`` splits them; a node only needs nodes of its own side. Each is checked
here with its located message, through the Python API and the CLI.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from composer import PipelineInvalid, Registry
from composer.cli import main
from composer.export import kv_transfer_config
from composer.validation import load_pipeline, validate_text

#: The P/D pipeline: a CPU tier beside a NIXL transport, on both sides.
PD = """\
version: 1
nodes:
  cpu:
    plugin: cache
    config: {capacity: 64MiB}
  nixl:
    plugin: vllm
    role: transport
    config: {connector: NixlConnector, kv_buffer_device: cpu}
load_order: [cpu, nixl]
load_policy: longest_hit
"""

#: A tier alone: nothing moves KV from one engine to the other.
TIER_ONLY = """\
version: 1
kv_role: kv_consumer
nodes:
  cpu:
    plugin: cache
    config: {capacity: 64MiB}
"""


def check(registry: Registry, text: str, kv_role: str | None = None) -> list[str]:
    with pytest.raises(PipelineInvalid) as info:
        validate_text(textwrap.dedent(text), file="p.yaml", registry=registry, kv_role=kv_role)
    return [str(p) for p in info.value.problems]


def resolve(registry: Registry, text: str, kv_role: str | None = None):  # type: ignore[no-untyped-def]
    return validate_text(textwrap.dedent(text), file="p.yaml", registry=registry, kv_role=kv_role)


# --------------------------------------------------------------------------- #
# One file, both sides
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("given", "kv_role"),
    [
        (None, "kv_both"),
        ("producer", "kv_producer"),
        ("consumer", "kv_consumer"),
        ("both", "kv_both"),
        ("kv_consumer", "kv_consumer"),
    ],
)
def test_one_file_serves_each_side(registry: Registry, given: str | None, kv_role: str) -> None:
    pipeline = resolve(registry, PD, given)
    assert pipeline.kv_role == kv_role
    assert [n.id for n in pipeline.nodes] == ["cpu", "nixl"]
    # What vLLM gets, and the inline copy its processes validate again, say the side.
    config = kv_transfer_config(pipeline)
    assert config["kv_role"] == kv_role
    assert config["kv_connector_extra_config"]["pipeline"].get("kv_role", "kv_both") == kv_role
    # ... and the inline copy is itself a valid pipeline of that side.
    again = load_pipeline(config["kv_connector_extra_config"]["pipeline"], registry=registry)
    assert again.kv_role == kv_role


def test_the_side_given_where_it_runs_wins_over_the_files(registry: Registry) -> None:
    text = PD.replace("version: 1\n", "version: 1\nkv_role: kv_producer\n")
    assert resolve(registry, text, "consumer").kv_role == "kv_consumer"


def test_a_side_that_is_no_side_is_the_callers_mistake(registry: Registry) -> None:
    for bad in ("prefill", "", "KV_CONSUMER", 3):
        with pytest.raises(ValueError, match="is not a side's role; expected one of producer"):
            resolve(registry, PD, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not a side's role"):
        load_pipeline({"version": 1, "nodes": {}}, kv_role="decode")


# --------------------------------------------------------------------------- #
# A side needs its transport
# --------------------------------------------------------------------------- #


def test_a_consumer_without_a_transport_is_located_at_the_files_kv_role(
    registry: Registry,
) -> None:
    assert check(registry, TIER_ONLY) == [
        'p.yaml:2:10: kv_role: the consumer side (kv_consumer) needs a transport node that '
        "loads, to receive the prompt's KV from the prefill side: a node with role: transport "
        '(e.g. plugin: vllm, connector: NixlConnector), or a plugin: vllm node; nodes on this '
        'side: "cpu"'
    ]


def test_a_consumer_given_where_it_runs_is_located_at_the_nodes(registry: Registry) -> None:
    text = TIER_ONLY.replace("kv_role: kv_consumer\n", "")
    assert resolve(registry, text).kv_role == "kv_both"  # kv_both needs no transport
    (message,) = check(registry, text, "consumer")
    assert message.startswith(
        "p.yaml:3:3: nodes: the consumer side (kv_consumer, given where it runs) needs a "
        "transport node that loads"
    )


def test_a_producer_without_a_transport_ships_nothing(registry: Registry) -> None:
    text = TIER_ONLY.replace("kv_role: kv_consumer\n", "")
    (message,) = check(registry, text, "producer")
    assert "the producer side (kv_producer, given where it runs) needs a transport node " \
        "that saves, to ship the prompt's KV to the decode side" in message


def test_a_disabled_transport_does_not_count(registry: Registry) -> None:
    text = PD.replace("    role: transport\n", "    role: transport\n    enabled: false\n")
    (message,) = check(registry, text, "consumer")
    assert "needs a transport node that loads" in message and '"cpu"' in message


def test_the_transport_must_be_in_the_sides_order(registry: Registry) -> None:
    assert check(registry, PD.replace("[cpu, nixl]", "[cpu]"), "consumer") == [
        'p.yaml:10:13: load_order: the consumer side (kv_consumer) loads through its '
        'transport node "nixl", but load_order leaves it out'
    ]
    assert check(registry, PD + "save_to: [cpu]\n", "producer") == [
        'p.yaml:12:10: save_to: the producer side (kv_producer) saves through its transport '
        'node "nixl", but save_to leaves it out'
    ]
    # Each side checks its own list only.
    assert resolve(registry, PD + "save_to: [cpu]\n", "consumer").save_to == ("cpu",)


def test_multiconnector_children_serve_as_the_transport(registry: Registry) -> None:
    """vLLM configures a native connector with the engine's kv_role itself, as
    MultiConnector does its children: a pipeline of them needs no role: transport."""
    text = """\
        version: 1
        kv_role: kv_consumer
        nodes:
          nixl: {plugin: vllm, config: {connector: NixlConnector}}
          disk: {plugin: vllm, config: {connector: ExampleConnector}}
    """
    assert resolve(registry, text).kv_role == "kv_consumer"


# --------------------------------------------------------------------------- #
# One transport per side; sides
# --------------------------------------------------------------------------- #

TWO_TRANSPORTS = """\
version: 1
nodes:
  cpu:
    plugin: cache
    config: {capacity: 64MiB}
  nixl:
    plugin: vllm
    role: transport
    config: {connector: NixlConnector}
  storage:
    plugin: vllm
    role: transport
    config: {connector: ExampleConnector}
"""


def test_two_transports_on_one_side_are_refused(registry: Registry) -> None:
    assert check(registry, TWO_TRANSPORTS) == [
        f'p.yaml:12:11: nodes.storage.role: both "nixl" and "storage" are transport nodes on '
        f'the {side} side; at most one transport per side (give them different sides: '
        '"sides: [producer]" / "sides: [consumer]", or remove one)'
        for side in ("producer", "consumer")
    ]


def test_sides_split_two_transports_and_each_engine_runs_its_own(registry: Registry) -> None:
    text = TWO_TRANSPORTS.replace(
        "    role: transport\n    config: {connector: ExampleConnector}",
        "    role: transport\n    sides: [consumer]\n    config: {connector: ExampleConnector}",
    ).replace(
        "    role: transport\n    config: {connector: NixlConnector}",
        "    role: transport\n    sides: [producer]\n    config: {connector: NixlConnector}",
    )
    both = resolve(registry, text)
    assert [(n.id, n.sides) for n in both.nodes] == [
        ("cpu", ("producer", "consumer")), ("nixl", ("producer",)), ("storage", ("consumer",))
    ]
    producer = resolve(registry, text, "producer")
    assert [n.id for n in producer.nodes] == ["cpu", "nixl"]
    assert producer.load_order == ("cpu", "nixl")
    consumer = resolve(registry, text, "consumer")
    assert [n.id for n in consumer.nodes] == ["cpu", "storage"]
    assert consumer.save_to == ("cpu", "storage")


def test_a_node_needs_only_nodes_of_its_side(registry: Registry) -> None:
    text = """\
        version: 1
        nodes:
          tracker: {plugin: tracker, sides: [producer]}
          blend: {plugin: blend, needs: [tracker]}
          nixl: {plugin: vllm, role: transport, config: {connector: NixlConnector}}
    """
    assert resolve(registry, text, "producer").node("blend").needs == ("tracker",)
    assert check(registry, text, "consumer") == [
        'p.yaml:4:34: nodes.blend.needs[0]: node "tracker" runs only on the producer side, so '
        'not on a kv_consumer engine, where "blend" runs and needs it'
    ]


@pytest.mark.parametrize(
    ("sides", "message"),
    [
        ("[producer, producer]", 'nodes.nixl.sides[1]: side "producer" is listed twice'),
        ("[]", "nodes.nixl.sides: list should have at least 1 item after validation"),
        (
            "[prefill]",
            'nodes.nixl.sides[0]: "prefill" is not allowed; expected one of "consumer", '
            '"producer"',
        ),
        ("[producr]", '"producr" is not allowed (did you mean "producer"?)'),
        ("producer", 'nodes.nixl.sides: expected a list, got "producer"'),
        ("[1]", 'nodes.nixl.sides[0]: 1 is not allowed'),
        ("{a: 1}", "nodes.nixl.sides: expected a list"),
        ("[[producer]]", "nodes.nixl.sides[0]:"),
        ("null", None),
    ],
)
def test_hostile_sides_are_located(registry: Registry, sides: str, message: str | None) -> None:
    text = PD.replace("    role: transport\n", f"    role: transport\n    sides: {sides}\n")
    if message is None:  # null: the default, both sides
        assert resolve(registry, text).node("nixl").sides == ("producer", "consumer")
        return
    found = check(registry, text)
    assert any(message in p for p in found), found
    assert all(p.startswith("p.yaml:") for p in found)


def test_a_huge_sides_list_is_bounded(registry: Registry) -> None:
    many = "[" + ", ".join(["producer"] * 5000) + "]"
    text = PD.replace("    role: transport\n", f"    role: transport\n    sides: {many}\n")
    found = check(registry, text)
    # One message per repeat, each located: no crash, no quadratic blow-up.
    assert len(found) == 4999 and found[0].startswith("p.yaml:9:")


# --------------------------------------------------------------------------- #
# The CLI: --kv-role on validate, export, graph, serve
# --------------------------------------------------------------------------- #


@pytest.fixture
def pd_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "pd.yaml"
    path.write_text(PD.replace("plugin: cache\n    config: {capacity: 64MiB}",
                               "plugin: offload-cpu\n    config: {capacity: 64MiB}"))
    (tmp_path / "tier.yaml").write_text(
        TIER_ONLY.replace("kv_role: kv_consumer\n", "").replace(
            "plugin: cache", "plugin: offload-cpu"
        )
    )
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_export_for_each_side(pd_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for side in ("producer", "consumer", "both"):
        code, out, _ = run(capsys, "export", "--kv-role", side, "pd.yaml")
        assert code == 0
        assert json.loads(out)["kv_role"] == f"kv_{side}"
        code, out, _ = run(capsys, "export", "--reference", "--kv-role", side, "pd.yaml")
        assert json.loads(out)["kv_connector_extra_config"] == {
            "pipeline": str(pd_file), "kv_role": f"kv_{side}"
        }


def test_validate_for_a_side_exits_2_with_the_located_problem(
    pd_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "validate", "--kv-role", "both", "tier.yaml")[0] == 0
    code, out, err = run(capsys, "validate", "--kv-role", "consumer", "tier.yaml")
    assert code == 2
    assert out.startswith("tier.yaml:3:3: nodes: the consumer side (kv_consumer, given where it ")
    code, _, err = run(capsys, "export", "--kv-role", "consumer", "tier.yaml")
    assert code == 2 and err.startswith("tier.yaml:3:3: nodes: the consumer side")


def test_a_role_that_is_no_side_is_a_usage_error(
    pd_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "export", "--kv-role", "decode", "pd.yaml")
    assert (code, out) == (2, "")
    assert "argument --kv-role: invalid choice: 'decode'" in err


def test_graph_shows_what_each_node_does_on_each_side(
    pd_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "graph", "--kv-role", "consumer", "pd.yaml")
    assert code == 0
    assert out.endswith(
        textwrap.dedent(
            """\
            P/D sides (this engine: kv_consumer):
              cpu   producer  serves prefixes it holds; saves the prompts it prefills
                    consumer  serves prefixes it holds; saves what arrives and what decode adds
              nixl  producer  ships the prompt's KV to the decode engine
                    consumer  receives the prompt's KV from the prefill engine
            """
        )
    )
    code, out, _ = run(capsys, "--json", "graph", "pd.yaml")
    assert json.loads(out)["nodes"][1]["sides"] == {
        "producer": "ships the prompt's KV to the decode engine",
        "consumer": "receives the prompt's KV from the prefill engine",
    }


def test_serve_passes_the_side_to_vllm(pd_file: Path) -> None:
    from composer.cli.serve import serve_command

    command = serve_command("pd.yaml", ["MODEL"], "consumer")
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert config["kv_role"] == "kv_consumer"
    assert config["kv_connector_extra_config"] == {
        "pipeline": str(pd_file), "kv_role": "kv_consumer"
    }
    with pytest.raises(PipelineInvalid, match="the consumer side"):
        serve_command("tier.yaml", ["MODEL"], "consumer")


def test_kvc_serve_refuses_a_consumer_without_transport_before_vllm(
    pd_file: Path, kvc: str
) -> None:
    proc = subprocess.run(
        [kvc, "serve", "--kv-role", "consumer", "tier.yaml", "--", "MODEL"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("tier.yaml:3:3: nodes: the consumer side (kv_consumer")
    assert "Traceback" not in proc.stderr and "+ " not in proc.stderr


def test_the_docs_show_what_kvc_prints_for_a_side(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(root)
    readme = (root / "docs" / "disaggregated.md").read_text()
    for command in ("kvc validate --kv-role consumer examples/cpu-offload.yaml",
                    "kvc graph examples/pd-nixl.yaml"):
        shown = readme.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
        code, out, err = run(capsys, *command.split()[1:])
        assert code == (2 if "validate" in command else 0)
        out += err  # (the count of problems; a terminal shows both)
        if shown.startswith("...\n"):  # the tail of what it prints
            assert out.endswith(shown.removeprefix("...\n"))
        else:
            assert out == shown


# --------------------------------------------------------------------------- #
# NIXL's progress thread (nixl_poll_ms)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("connector", ["NixlConnector", "NixlPullConnector", "NixlPushConnector"])
@pytest.mark.parametrize("poll_ms", [0, 1, 1000])
def test_nixl_connectors_take_the_poll_wait(
    registry: Registry, connector: str, poll_ms: int
) -> None:
    text = PD.replace("NixlConnector,", f"{connector}, nixl_poll_ms: {poll_ms},")
    assert resolve(registry, text, "consumer").node("nixl").config.nixl_poll_ms == poll_ms


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("connector: OffloadingConnector, nixl_poll_ms: 1", "applies to NIXL connectors"),
        ("connector: NixlConnector, nixl_poll_ms: -1", "greater than or equal to 0"),
        ("connector: NixlConnector, nixl_poll_ms: 1001", "less than or equal to 1000"),
        ("connector: NixlConnector, nixl_poll_ms: fast", "expected an integer"),
        ("connector: NixlConnector, nixl_poll_ms: 1.5", "expected an integer"),
    ],
)
def test_a_bad_poll_wait_is_located(registry: Registry, config: str, message: str) -> None:
    text = PD.replace("connector: NixlConnector, kv_buffer_device: cpu", config)
    (problem,) = check(registry, text)
    line = text.splitlines()[8]  # the nixl node's config, at the value
    column = line.index("nixl_poll_ms: ") + len("nixl_poll_ms: ") + 1
    assert problem.startswith(f"p.yaml:9:{column}: nodes.nixl.config.nixl_poll_ms: ")
    assert message in problem


@pytest.mark.parametrize("poll_ms", [1, 20])
def test_nixls_agents_get_the_nodes_poll_wait(poll_ms: int) -> None:
    """Against the installed NIXL: inside the node's context an agent NIXL's Python API
    makes (through its bindings, as vLLM's NIXL worker does) gets the wait, in us;
    NIXL's own bindings are back after."""
    import importlib

    from composer.builtin import NIXL_API, VllmConnectorConfig
    from composer.vllm.native import nixl_poll

    api = importlib.import_module(NIXL_API)
    bindings = api.nixlBind
    assert bindings.nixlAgentConfig().pthrDelay == 0  # NIXL's own: no wait
    with nixl_poll(VllmConnectorConfig(connector="NixlConnector", nixl_poll_ms=poll_ms)):
        config = api.nixlBind.nixlAgentConfig()
        agent = api.nixlBind.nixlAgent(f"kvc-test-{poll_ms}", config)
        assert config.pthrDelay == poll_ms * 1000
        assert agent is not None
    assert api.nixlBind is bindings
    with nixl_poll(VllmConnectorConfig(connector="NixlConnector")):
        assert api.nixlBind is bindings
