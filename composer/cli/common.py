"""What every ``kvc`` command shares: exit codes, the two user-facing errors, loading
a pipeline (a file or stdin), and small text and JSON helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from pydantic_core import to_jsonable_python

from composer.discovery import Registry
from composer.errors import PipelineInvalid, Problem, escape
from composer.export import CONNECTOR_NAME, as_multiconnector
from composer.loader import FileProblem, read_pipeline_stream
from composer.model.kv_groups import ModelConfigError, ModelKV, group_rows, predict
from composer.pipeline import ResolvedNode, ResolvedPipeline
from composer.validation import load_pipeline, validate_text

EXIT_OK = 0
EXIT_ENVIRONMENT = 1
EXIT_INVALID = 2


def stop_servers_on_sigterm() -> None:
    """SIGTERM (``timeout``, a CI runner, ``kill``) ends the command as an exception
    does, so the servers it started in their own process groups are stopped on the
    way out. Python's default would end it at once and leave them running."""

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


class CommandError(Exception):
    """A user-facing failure that is not about a pipeline's contents (exit 2)."""


class MissingRuntime(Exception):
    """A command needs vLLM (or torch) and it is not importable here (exit 1)."""


def load(file: str, registry: Registry, kv_role: str | None = None) -> ResolvedPipeline:
    """Validate ``file`` (``-``: stdin), for the P/D side ``kv_role`` when given."""
    if file == "-":
        try:
            # Bytes, decoded strictly: the locale's decoder may keep bad bytes as surrogates.
            text = read_pipeline_stream(sys.stdin.buffer)
        except FileProblem as exc:
            message = exc.message.replace("pipeline file", "input")
            raise PipelineInvalid(
                [Problem((), message, "<stdin>", exc.line, exc.column)]
            ) from None
        except OSError as exc:
            raise PipelineInvalid(
                [Problem((), f"cannot read input: {exc.strerror or exc}", "<stdin>")]
            ) from None
        return validate_text(text, file="<stdin>", registry=registry, kv_role=kv_role)
    return load_pipeline(file, registry=registry, kv_role=kv_role)


def print_problems(problems: Sequence[Problem], stream: TextIO) -> None:
    for problem in problems:
        print(problem, file=stream)


def plugin_label(node: ResolvedNode) -> str:
    """Raw (user text included): callers escape it for their output."""
    if node.plugin.name == "vllm":
        return f"vllm ({getattr(node.config, 'connector', '?')})"
    return str(node.plugin.name)


def runs_as(pipeline: ResolvedPipeline) -> str:
    return "MultiConnector" if as_multiconnector(pipeline) else CONNECTOR_NAME


def disabled_nodes(pipeline: ResolvedPipeline) -> list[str]:
    nodes = pipeline.source.get("nodes", {})
    return [n for n, s in nodes.items() if isinstance(s, dict) and s.get("enabled") is False]



def dump(data: Any) -> str:
    return json.dumps(to_jsonable_python(data, fallback=str), indent=2, sort_keys=False)



def plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"



@contextlib.contextmanager
def needs_runtime(what: str) -> Iterator[None]:
    """Turn a missing vLLM / torch into a one-line hint instead of a traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("vllm", "torch"):
            raise
        raise MissingRuntime(
            f"{what} needs vLLM ({exc}); install it with "
            "`pip install 'kv-composer[vllm]'` or run `make demo`"
        ) from None


def predict_model(args: argparse.Namespace) -> ModelKV | None:
    """The ``--model`` prediction, or None without one; an unusable model is a usage error."""
    if getattr(args, "model", None) is None:
        return None
    try:
        return predict(args.model, block_size=args.block_size)
    except ModelConfigError as exc:
        raise CommandError(f"--model: {exc}") from None


def model_lines(model: ModelKV) -> list[str]:
    """The model's predicted groups, as ``kvc validate`` and ``kvc graph`` show them."""
    count = len(model.groups)
    lines = [
        f"model {model.name} ({model.architecture}): {count} KV cache group"
        f"{'s' * (count != 1)}{' (hybrid)' if model.hybrid else ''}"
    ]
    lines += [f"  {row}" for row in group_rows(model.groups)]
    lines += [f"  note: {note}" for note in model.notes]
    return [escape(line) for line in lines]
