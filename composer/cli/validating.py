"""``kvc validate``, ``kvc schema`` and ``kvc export``: check a pipeline, describe
every valid one (JSON Schema), and turn one into vLLM's ``--kv-transfer-config``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer.cli.common import (
    EXIT_INVALID,
    EXIT_OK,
    CommandError,
    MissingRuntime,
    dump,
    load,
    plural,
    print_problems,
    runs_as,
)
from composer.discovery import Registry, discover
from composer.errors import PipelineInvalid, Problem, escape
from composer.export import kv_transfer_config
from composer.loader import FileProblem
from composer.pipeline import SCHEMA_ID, ResolvedPipeline, typed_pipeline_model

SCHEMA_FILE = "pipeline.schema.json"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def schema_json(registry: Registry) -> str:
    """The pipeline JSON Schema (every installed plugin's config included), as written to disk."""
    schema = typed_pipeline_model(dict(registry.types)).model_json_schema()
    schema["$id"] = SCHEMA_ID
    schema["$schema"] = JSON_SCHEMA_DIALECT
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


@dataclass
class _Checked:
    file: str
    pipeline: ResolvedPipeline | None
    problems: list[Problem]

    def as_dict(self) -> dict[str, Any]:
        ok = self.pipeline is not None and not self.problems
        return {
            "file": self.file,
            "ok": ok,
            "problems": [p.as_dict() for p in self.problems],
            "nodes": [n.id for n in self.pipeline.nodes] if self.pipeline and ok else [],
            "runs_as": runs_as(self.pipeline) if self.pipeline and ok else None,
        }



def cmd_validate(args: argparse.Namespace) -> int:
    registry = discover()
    results: list[_Checked] = []
    for file in args.files:
        try:
            pipeline = load(file, registry)
            deep = _deep_problems(pipeline, file) if args.deep else []
            results.append(_Checked(file, pipeline, deep))
        except PipelineInvalid as exc:
            results.append(_Checked(file, None, list(exc.problems)))

    invalid = [r for r in results if r.problems]
    if args.json:
        print(dump({"ok": not invalid, "files": [r.as_dict() for r in results]}))
        return EXIT_INVALID if invalid else EXIT_OK
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
    if invalid:
        count = sum(len(r.problems) for r in invalid)
        print(
            f"{plural(count, 'problem')} in {plural(len(invalid), 'file')}", file=sys.stderr
        )
    return EXIT_INVALID if invalid else EXIT_OK


def _deep_problems(pipeline: ResolvedPipeline, file: str) -> list[Problem]:
    from composer.deep_check import deep_check
    from composer.loader import load_yaml, read_pipeline_file

    marks = None
    if file != "-":
        # The file was read successfully a moment ago; its marks locate the problems.
        try:
            _, marks, _ = load_yaml(read_pipeline_file(file))
        except FileProblem:  # replaced since: report without locations
            marks = None
    try:
        return deep_check(pipeline, marks=marks)
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
    pipeline = load(args.file, discover())
    reference = None
    if args.reference:
        if args.file == "-":
            raise CommandError("--reference needs a file path, not stdin")
        reference = os.path.abspath(args.file)
    print(json.dumps(kv_transfer_config(pipeline, reference=reference)))
    return EXIT_OK

