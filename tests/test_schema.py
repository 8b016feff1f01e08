"""The checked-in JSON Schema matches the installed plugins and accepts the examples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from composer import discover
from composer.cli.validating import schema_json
from composer.discovery import ALLOW_ENV, DENY_ENV
from composer.loader import PipelineLoader
from composer.pipeline import SCHEMA_ID


@pytest.fixture
def schema(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((root / "schemas/pipeline.schema.json").read_text())
    return data


def test_checked_in_schema_is_fresh(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.delenv(DENY_ENV, raising=False)
    fresh = schema_json(discover())
    current = (root / "schemas/pipeline.schema.json").read_text()
    assert current == fresh, (
        "schemas/pipeline.schema.json is stale (a pipeline model or an installed plugin's "
        "config changed): regenerate it with `make schema` and commit it"
    )


def test_schema_is_valid_draft_2020_12_with_our_id(schema: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$id"] == SCHEMA_ID
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_schema_has_a_node_variant_per_installed_plugin(schema: dict[str, Any]) -> None:
    consts = {
        d["properties"]["plugin"]["const"]
        for name, d in schema["$defs"].items()
        if name.startswith("Node_")
    }
    assert consts == set(discover().names())


def _errors(schema: dict[str, Any], data: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return sorted(e.message for e in validator.iter_errors(data))


def test_schema_checks_plugin_config(schema: dict[str, Any]) -> None:
    ok = {"version": 1, "nodes": {"n": {"plugin": "vllm", "config": {"connector": "X"}}}}
    assert _errors(schema, ok) == []
    for bad_node in (
        {"plugin": "vllm", "config": {"connecter": "X"}},  # unknown config key
        {"plugin": "vllm", "config": {}},  # missing required key
        {"plugin": "vllm", "config": {"connector": "X", "kv_port": "high"}},  # wrong type
        {"plugin": "no-such-plugin"},
    ):
        assert _errors(schema, {"version": 1, "nodes": {"n": bad_node}}), bad_node
    assert _errors(schema, {"version": 1, "nodes": {"1bad": {"plugin": "vllm"}}})
    assert _errors(schema, {"version": 1, "nodes": {}})


def test_examples_match_the_schema_as_an_editor_reads_them(
    schema: dict[str, Any], root: Path
) -> None:
    examples = sorted((root / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        # YAML 1.2 booleans and no env expansion: what yaml-language-server sees.
        data = yaml.load(path.read_text(), Loader=PipelineLoader)  # noqa: S506 - a SafeLoader
        assert _errors(schema, data) == [], path.name
