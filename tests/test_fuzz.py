"""Throw thousands of mutated pipeline files at the validator.

Whatever the text, ``validate_text`` either returns a resolved pipeline or
raises ``PipelineInvalid`` whose problems are located as ``file:line:col``.
Any other exception is a crash a user would see as a traceback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from composer import PipelineInvalid, ResolvedPipeline, discover, load_pipeline, validate_text

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# A seed that reaches the graph and capability checks with the test plugin types alone.
GRAPH_SEED = """\
version: 1
kv_role: kv_both
load_policy: longest_hit
hma: auto
nodes:
  tracker:
    plugin: vllm
    config:
      connector: ${TRACKER:-Tracker}
      capabilities: {provides_model: true}
  blend:
    plugin: vllm
    needs: [tracker]
    on_error: recompute
    config:
      connector: Blend
      extra_config: {chunk_size: 256, nested: {a: [1, 2]}}
      capabilities: {needs_model: true, kv_layout: HND}
  disk:
    plugin: vllm
    enabled: true
    config:
      connector: ExampleConnector
      kv_port: ${PORT}
      extra_config:
        shared_storage_path: ${DIR:-kv-store}
  nixl:
    plugin: vllm
    role: transport
    config:
      connector: NixlConnector
      kv_buffer_device: cpu
      capabilities: {hma: true, kv_layout: HND, transfer_params_keys: [remote_host]}
load_order: [disk, blend, nixl]
save_to: [disk, nixl]
"""

SEEDS = [GRAPH_SEED, *(p.read_text() for p in sorted(EXAMPLES.glob("*.yaml")))]
ENV = {"MIN_BLOCKS": "4", "EMPTY": "", "PORT": "8000"}
# Installed plugins only: the examples' plugins validate their own configs.
REGISTRY = discover()

SYNTAX = list(":{}[],-#&*!|>'\"%@`?~ \n\t$.0123456789abc")
WORDS = [
    "version", "nodes", "plugin", "config", "needs", "role", "load_order", "save_to",
    "load_policy", "hma", "kv_role", "enabled", "on_error", "capacity", "connector",
    "capabilities", "tracker", "blend", "disk", "nixl", "vllm", "service", "transport",
    "offload-cpu", "on", "off",
    "true", "null", "~", "1", "-1", "1e400", "0x10", "8GiB", "[]", "{}", "[a, b]", "{a: 1}",
    "${MIN_BLOCKS}", "${UNSET}", "${EMPTY:-3}", "$$", "!!str 1", "!!binary aGk=", "&a x",
    "*a", "*nope", "<<: {}", '"\\u00e9"', "'it''s'", "|\n  text", ">-\n  text", "---", "...",
    "\u00e9\u4e2d\U0001f600", "\x00", "\ufeff", "\udce9",
    # Hostile: tags the constructors trust, wide numbers, recursive and exploding aliases,
    # merges, long unclosed references, terminal escapes and bidi overrides.
    "!!int abc", "!!float x", "!!bool maybe", "!!int 0xZZ", "!!int ''", "!!map x", "!!seq 1",
    "9" * 200, "0x" + "f" * 150, "&r [*r]", "&m {<<: *m}", "<<: *a", "<<: [1]",
    "&b [&c [x, x, x, x], *c, *c, *c, *c]", "${A:-" * 50, "${" * 50, r'"\e[2J"',
    r'"\u202e"', r'"a\nb: 1"', "[" * 150, "{a: " * 150,
]
SYNTAX += list("\x1b\u202e\u2028\x85")  # raw controls and bidi characters too
# What must never reach a terminal raw from a problem line.
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
JSON_LIKE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_pipeline(draw: st.DrawFn) -> str:
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        lines = text.split("\n")
        op = draw(
            st.sampled_from(
                ["delete", "insert", "replace", "swap", "duplicate", "value", "key", "structure"]
            )
        )
        pos = draw(st.integers(0, max(len(text) - 1, 0)))
        if op == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 12)) :]
        elif op == "insert":
            chunk = draw(st.sampled_from(SYNTAX) | st.sampled_from(WORDS) | st.text(max_size=4))
            text = text[:pos] + chunk + text[pos:]
        elif op == "replace":
            text = text[:pos] + draw(st.sampled_from(SYNTAX)) + text[pos + 1 :]
        elif op in ("swap", "duplicate"):
            i = draw(st.integers(0, len(lines) - 1))
            j = draw(st.integers(0, len(lines) - 1))
            if op == "swap":
                lines[i], lines[j] = lines[j], lines[i]
            else:
                lines.insert(j, lines[i])
            text = "\n".join(lines)
        elif op in ("value", "key"):
            keyed = [i for i, line in enumerate(lines) if re.match(r"\s*[\w-]+:", line)]
            if keyed:
                i = draw(st.sampled_from(keyed))
                key, _, value = lines[i].partition(":")
                word = draw(st.sampled_from(WORDS))
                if op == "value":
                    lines[i] = f"{key}: {word}"
                else:
                    indent = key[: len(key) - len(key.lstrip())]
                    lines[i] = f"{indent}{word}:{value}"
                text = "\n".join(lines)
        else:
            # A random structure in place of the whole file or of one value.
            blob = yaml.safe_dump(draw(JSON_LIKE), default_flow_style=True, width=1000).strip()
            keyed = [i for i, line in enumerate(lines) if re.match(r"\s*[\w-]+:", line)]
            if keyed and draw(st.booleans()):
                i = draw(st.sampled_from(keyed))
                lines[i] = f"{lines[i].partition(':')[0]}: {blob}"
                text = "\n".join(lines)
            else:
                text = blob
    return text


LOCATED = re.compile(r"^fuzz\.yaml:(\d+):(\d+): \S.*: .+$", re.DOTALL)
UNLOCATED = re.compile(r"^fuzz\.yaml: \S.*: .+$", re.DOTALL)


@settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(text=mutated_pipeline())
def test_mutated_pipelines_never_crash(text: str) -> None:
    try:
        result = validate_text(text, file="fuzz.yaml", registry=REGISTRY, env=ENV)
    except PipelineInvalid as exc:
        assert exc.problems, "PipelineInvalid without problems"
        n_lines = text.count("\n") + 1
        for problem in exc.problems:
            rendered = str(problem)
            assert not UNSAFE.search(rendered), rendered
            if problem.line is None:
                assert UNLOCATED.match(rendered), rendered
            else:
                assert LOCATED.match(rendered), rendered
                assert 1 <= problem.line <= n_lines + 1, rendered
                assert problem.column is not None and problem.column >= 1, rendered
    else:
        assert isinstance(result, ResolvedPipeline)
        assert result.nodes, "a valid pipeline has at least one enabled node"


_LEAF = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
    | st.binary(max_size=3)
    | st.sampled_from(["vllm", "offload-cpu", "lmcache", "load", "both", "8GiB", "NixlConnector"])
)
_KEYS = st.sampled_from(WORDS[:24]) | st.text(max_size=4) | st.integers()
_DATA = st.recursive(
    _LEAF,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(_KEYS, c, max_size=5) | st.tuples(c),
    max_leaves=20,
)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.dictionaries(_KEYS, _DATA, max_size=6), versioned=st.booleans())
def test_python_data_gives_a_pipeline_or_pipeline_invalid(
    data: dict[object, object], versioned: bool
) -> None:
    """The Python API on arbitrary data (int keys, bytes, tuples): no other exception."""
    if versioned:
        data["version"] = 1
    try:
        load_pipeline(data, registry=REGISTRY)  # type: ignore[arg-type]
    except PipelineInvalid as exc:
        for problem in exc.problems:
            assert not UNSAFE.search(str(problem)), str(problem)
            json.dumps(problem.as_dict())
