"""``kvc validate``, ``kvc schema`` and ``kvc export``: check a pipeline, describe
every valid one (JSON Schema), and turn one into vLLM's ``--kv-transfer-config``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from composer.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    CommandError,
    MissingRuntime,
    dump,
    load,
    model_lines,
    plural,
    predict_model,
    print_problems,
    runs_as,
)
from composer.discovery import Registry, discover
from composer.errors import PipelineInvalid, Problem, escape
from composer.export import kv_transfer_config
from composer.loader import file_marks
from composer.model.kv_groups import group_rows
from composer.pipeline import SCHEMA_ID, ResolvedPipeline, typed_pipeline_model
from composer.validation.deep_check import deep_check, sleep_mode_problems
from composer.validation.model_check import ModelCheck, check_model
from composer.validation.policies import add_policies_to_schema

SCHEMA_FILE = "pipeline.schema.json"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def schema_json(registry: Registry) -> str:
    """The pipeline JSON Schema (every installed plugin's config included, and the cache
    policies their configs may name, with their options), as written to disk."""
    schema = typed_pipeline_model(dict(registry.types)).model_json_schema()
    add_policies_to_schema(schema, registry)
    schema["$id"] = SCHEMA_ID
    schema["$schema"] = JSON_SCHEMA_DIALECT
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


@dataclass
class _Checked:
    file: str
    pipeline: ResolvedPipeline | None
    problems: list[Problem]
    model: ModelCheck | None = None

    def as_dict(self) -> dict[str, Any]:
        ok = self.pipeline is not None and not self.problems
        out = {
            "file": self.file,
            "ok": ok,
            "problems": [p.as_dict() for p in self.problems],
            "nodes": [n.id for n in self.pipeline.nodes] if self.pipeline and ok else [],
            "runs_as": runs_as(self.pipeline) if self.pipeline and ok else None,
        }
        if self.model is not None:
            out["model"] = {
                "hma_off": self.model.hma_off or None,
                "groups": [asdict(g) for g in self.model.runs.groups],
                "serves": self.model.serves,
                "notes": list(self.model.notes),
            }
        return out


def cmd_validate(args: argparse.Namespace) -> int:
    registry = discover()
    model = predict_model(args)
    results: list[_Checked] = []
    for file in args.files:
        try:
            pipeline = load(file, registry, args.kv_role)
            deep = _deep_problems(pipeline, file, registry) if args.deep else []
            if args.enable_sleep_mode:
                deep += _sleep_mode_problems(pipeline, file)
            checked = _Checked(file, pipeline, deep)
            if model is not None:
                checked.model = check_model(pipeline, model, marks=file_marks(file))
                checked.problems += checked.model.problems
            results.append(checked)
        except PipelineInvalid as exc:
            results.append(_Checked(file, None, list(exc.problems)))

    invalid = [r for r in results if r.problems]
    if args.json:
        data: dict[str, Any] = {"ok": not invalid, "files": [r.as_dict() for r in results]}
        if model is not None:
            data["model"] = asdict(model)
        print(dump(data))
        return EXIT_INVALID if invalid else EXIT_OK
    if model is not None:
        print("\n".join(model_lines(model)))
    for r in results:
        if r.problems or r.pipeline is None:
            print_problems(r.problems, sys.stdout)
            continue
        names = ", ".join(n.id for n in r.pipeline.nodes)
        print(
            escape(
                f"{r.file}: ok ({plural(len(r.pipeline.nodes), 'node')}: {names}; "
                f"runs as {runs_as(r.pipeline)})"
            )
        )
        if r.model is not None:
            print("\n".join(_served_lines(r.model)))
    if invalid:
        count = sum(len(r.problems) for r in invalid)
        print(
            f"{plural(count, 'problem')} in {plural(len(invalid), 'file')}", file=sys.stderr
        )
    return EXIT_INVALID if invalid else EXIT_OK


def _served_lines(check: ModelCheck) -> list[str]:
    lines = [f"  note: {note}" for note in check.notes]
    if check.runs is not check.model:
        lines += [f"  vLLM runs: {row}" for row in group_rows(check.runs.groups)]
    width = max((len(node_id) for node_id in check.serves), default=0)
    lines += [f"  {node_id:<{width}}  {line}" for node_id, line in check.serves.items()]
    return [escape(line) for line in lines]


def _sleep_mode_problems(pipeline: ResolvedPipeline, file: str) -> list[Problem]:
    try:
        # vLLM itself, asked only here: `kvc validate` without the flag stays light.
        from composer.vllm.pipeline_source import sleep_mode_refusals

        return sleep_mode_problems(pipeline, sleep_mode_refusals(pipeline), marks=file_marks(file))
    except ImportError as exc:
        raise MissingRuntime(f"--enable-sleep-mode needs vLLM importable ({exc})") from None


def _deep_problems(pipeline: ResolvedPipeline, file: str, registry: Registry) -> list[Problem]:
    marks = file_marks(file)
    try:
        return deep_check(pipeline, marks=marks, registry=registry)
    except ImportError as exc:
        raise MissingRuntime(f"--deep needs vLLM importable ({exc})") from None


def cmd_schema(args: argparse.Namespace) -> int:
    text = schema_json(discover())
    if args.output is None:
        sys.stdout.write(text)
        return EXIT_OK
    out = Path(args.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / SCHEMA_FILE).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {out / SCHEMA_FILE}: {exc.strerror or exc}") from None
    print(f"wrote {out / SCHEMA_FILE}", file=sys.stderr)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    pipeline = load(args.file, discover(), args.kv_role)
    reference = None
    if args.reference:
        if args.file == "-":
            raise CommandError("--reference needs a file path, not stdin")
        reference = os.path.abspath(args.file)
    print(json.dumps(kv_transfer_config(pipeline, reference=reference)))
    return EXIT_OK

