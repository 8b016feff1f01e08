"""``kvc``: validate, draw, export and run KV Composer pipelines.

Everything here stays importable without torch or vLLM: the commands that need
vLLM (``validate --deep``, ``serve``, ``demo``) import it inside the command.
User mistakes end with a located message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import pluggy
from pydantic import ByteSize, TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python

from composer.discovery import PluginConflict, PluginLoadError, Registry, discover
from composer.errors import PipelineInvalid, Problem, escape
from composer.export import CONNECTOR_NAME, as_multiconnector, kv_transfer_config
from composer.loader import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_NUMBER_CHARS,
    MAX_VALUES,
    FileProblem,
    read_pipeline_stream,
)
from composer.logs import configure
from composer.pipeline import SCHEMA_ID, ResolvedNode, ResolvedPipeline, typed_pipeline_model
from composer.plugin_types import Capabilities, PluginType
from composer.validation import load_pipeline, validate_text

EXIT_OK = 0
EXIT_ENVIRONMENT = 1
EXIT_INVALID = 2

SCHEMA_FILE = "pipeline.schema.json"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"



class CommandError(Exception):
    """A user-facing failure that is not about a pipeline's contents (exit 2)."""


class MissingRuntime(Exception):
    """A command needs vLLM (or torch) and it is not importable here (exit 1)."""


# --------------------------------------------------------------------------- #
# shared helpers
# --------------------------------------------------------------------------- #


def _load(file: str, registry: Registry) -> ResolvedPipeline:
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
        return validate_text(text, file="<stdin>", registry=registry)
    return load_pipeline(file, registry=registry)


def _print_problems(problems: Sequence[Problem], stream: TextIO) -> None:
    for problem in problems:
        print(problem, file=stream)


def _plugin_label(node: ResolvedNode) -> str:
    """Raw (user text included): callers escape it for their output."""
    if node.plugin.name == "vllm":
        return f"vllm ({getattr(node.config, 'connector', '?')})"
    return str(node.plugin.name)


def _runs_as(pipeline: ResolvedPipeline) -> str:
    return "MultiConnector" if as_multiconnector(pipeline) else CONNECTOR_NAME


def _disabled_nodes(pipeline: ResolvedPipeline) -> list[str]:
    nodes = pipeline.source.get("nodes", {})
    return [n for n, s in nodes.items() if isinstance(s, dict) and s.get("enabled") is False]


def schema_json(registry: Registry) -> str:
    """The pipeline JSON Schema (every installed plugin's config included), as written to disk."""
    schema = typed_pipeline_model(dict(registry.types)).model_json_schema()
    schema["$id"] = SCHEMA_ID
    schema["$schema"] = JSON_SCHEMA_DIALECT
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _dump(data: Any) -> str:
    return json.dumps(to_jsonable_python(data, fallback=str), indent=2, sort_keys=False)


# --------------------------------------------------------------------------- #
# commands
# --------------------------------------------------------------------------- #


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
            "runs_as": _runs_as(self.pipeline) if self.pipeline and ok else None,
        }


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def cmd_validate(args: argparse.Namespace) -> int:
    registry = discover()
    results: list[_Checked] = []
    for file in args.files:
        try:
            pipeline = _load(file, registry)
            deep = _deep_problems(pipeline, file) if args.deep else []
            results.append(_Checked(file, pipeline, deep))
        except PipelineInvalid as exc:
            results.append(_Checked(file, None, list(exc.problems)))

    invalid = [r for r in results if r.problems]
    if args.json:
        print(_dump({"ok": not invalid, "files": [r.as_dict() for r in results]}))
        return EXIT_INVALID if invalid else EXIT_OK
    for r in results:
        if r.problems or r.pipeline is None:
            _print_problems(r.problems, sys.stdout)
            continue
        names = ", ".join(n.id for n in r.pipeline.nodes)
        print(
            escape(
                f"{r.file}: ok ({_plural(len(r.pipeline.nodes), 'node')}: {names}; "
                f"runs as {_runs_as(r.pipeline)})"
            )
        )
    if invalid:
        count = sum(len(r.problems) for r in invalid)
        print(
            f"{_plural(count, 'problem')} in {_plural(len(invalid), 'file')}", file=sys.stderr
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


def cmd_graph(args: argparse.Namespace) -> int:
    pipeline = _load(args.file, discover())
    if args.json:
        print(_dump(_graph_data(pipeline)))
    elif args.format == "mermaid":
        print(_mermaid(pipeline))
    else:
        print(_graph_text(pipeline))
    return EXIT_OK


def _graph_data(p: ResolvedPipeline) -> dict[str, Any]:
    return {
        "file": p.file,
        "kv_role": p.kv_role,
        "hma": p.hma,
        "runs_as": _runs_as(p),
        "nodes": [
            {
                "id": n.id,
                "plugin": n.plugin.name,
                "connector": getattr(n.config, "connector", None)
                if n.plugin.name == "vllm"
                else None,
                "role": n.role,
                "needs": list(n.needs),
                "on_error": n.on_error,
            }
            for n in p.nodes
        ],
        "disabled": _disabled_nodes(p),
        "load_order": list(p.load_order),
        "load_policy": p.load_policy,
        "save_to": list(p.save_to),
    }


def _graph_text(p: ResolvedPipeline) -> str:
    labels = {n.id: escape(_plugin_label(n)) for n in p.nodes}
    id_width = max((len(n.id) for n in p.nodes), default=0)
    plugin_width = max((len(label) for label in labels.values()), default=0)
    lines = [
        f"pipeline {escape(p.file)}",
        f"  kv_role {p.kv_role}, hma {'on' if p.hma else 'off'}, runs as {_runs_as(p)}",
        "",
        "nodes (dependency order):",
    ]
    for n in p.nodes:
        row = f"  {n.id:<{id_width}}  {labels[n.id]:<{plugin_width}}  role {n.role}"
        if n.on_error != "fail":
            row += f", on_error {n.on_error}"
        if n.needs:
            row += f", needs {', '.join(n.needs)}"
        lines.append(row)
    disabled = _disabled_nodes(p)
    if disabled:
        lines.append(f"  disabled: {', '.join(disabled)}")
    lines += [
        "",
        f"load order ({p.load_policy}): {' -> '.join(p.load_order) or '(none)'}",
        f"save to: {', '.join(p.save_to) or '(none)'}",
    ]
    return "\n".join(lines)


_MERMAID_SAFE = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-.,:()"
)


def mermaid_text(text: str) -> str:
    """Text for inside a quoted Mermaid label: anything but letters, digits and a
    little punctuation becomes an entity code (``#34;``), so a name cannot close
    the label, start a new statement (``click``, ``%%{init}%%``) or carry HTML."""
    return "".join(c if c in _MERMAID_SAFE else f"#{ord(c)};" for c in text)


def _mermaid(p: ResolvedPipeline) -> str:
    # Mermaid ids are positional: node ids may contain '-', which Mermaid reads as an edge.
    ids = {n.id: f"n{i}" for i, n in enumerate(p.nodes)}
    lines = ["flowchart LR"]
    for n in p.nodes:
        label = "<br/>".join(
            mermaid_text(part) for part in (n.id, _plugin_label(n), f"role: {n.role}")
        )
        lines.append(f'  {ids[n.id]}["{label}"]')
    for n in p.nodes:
        for dep in n.needs:
            if dep in ids:
                lines.append(f"  {ids[n.id]} -. needs .-> {ids[dep]}")
    if p.load_order:
        lines.append(f'  load(["load: {p.load_policy}"])')
        for i, node_id in enumerate(p.load_order, 1):
            lines.append(f"  load -->|{i}| {ids[node_id]}")
    if p.save_to:
        lines.append('  save(["save"])')
        for node_id in p.save_to:
            lines.append(f"  save --> {ids[node_id]}")
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = discover()
    data = [_plugin_data(t) for t in registry.types.values()]
    if args.json:
        print(_dump(data))
        return EXIT_OK
    for i, (ptype, info) in enumerate(zip(registry.types.values(), data, strict=True)):
        if i:
            print()
        origin = " ".join(x for x in (info["package"], info["version"]) if x) or "unknown package"
        print(escape(f"{info['name']}  ({origin})"))
        if info["description"]:
            print(f"  {escape(info['description'])}")
        print(f"  roles: {', '.join(info['roles'])} (default {info['default_role']})")
        print(f"  runs in: {', '.join(info['vllm_roles'])}")
        classes = info["classes"]
        if len(set(classes.values())) == 1:
            print(escape(f"  class: {next(iter(classes.values()))}"))
        else:
            print(escape(f"  classes: {', '.join(f'{k} {v}' for k, v in classes.items())}"))
        caps = info["capabilities"]
        if isinstance(caps, str):
            print(f"  capabilities: {caps}")
        else:
            shown = [k if v is True else f"{k}={_show(v)}" for k, v in caps.items() if v]
            print(f"  capabilities: {', '.join(shown) or '(none)'}")
        fields = ptype.config_fields()
        if not fields:
            print("  config: (no options)")
            continue
        print("  config:")
        width = max(len(name) for name in fields)
        for name, f in fields.items():
            default = "required" if f["required"] else f"default {_show(f['default'])}"
            desc = f"  {f['description']}" if f["description"] else ""
            print(escape(f"    {name:<{width}}  {f['type']}, {default}{desc}"))
    return EXIT_OK


def _show(value: Any) -> str:
    if isinstance(value, ByteSize):
        return value.human_readable()
    if isinstance(value, list | tuple | set | frozenset):
        return "[" + ", ".join(str(v) for v in sorted(value, key=str)) + "]"
    return json.dumps(to_jsonable_python(value, fallback=str))


def _plugin_data(t: PluginType) -> dict[str, Any]:
    classes = {
        role: ref if isinstance(ref, str) else f"{ref.__module__}:{ref.__qualname__}"
        for role, ref in t.class_refs().items()
    }
    capabilities: Any = (
        t.capabilities.model_dump(mode="json")
        if isinstance(t.capabilities, Capabilities)
        else "depends on the node's config"
    )
    return {
        "name": t.name,
        "package": t.package,
        "version": t.version,
        "description": t.description,
        # The class of each vLLM process the node runs in.
        "classes": classes,
        "roles": sorted(t.roles),
        "default_role": t.default_role,
        "vllm_roles": sorted(t.vllm_roles),
        "capabilities": capabilities,
        "config": to_jsonable_python(t.config_fields(), fallback=str),
    }


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
    pipeline = _load(args.file, discover())
    reference = None
    if args.reference:
        if args.file == "-":
            raise CommandError("--reference needs a file path, not stdin")
        reference = os.path.abspath(args.file)
    print(json.dumps(kv_transfer_config(pipeline, reference=reference)))
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    vllm_args = list(args.vllm_args)
    if vllm_args[:1] == ["--"]:
        vllm_args = vllm_args[1:]
    with _needs_runtime("kvc serve"):
        from composer.serve import serve
    return serve(args.file, vllm_args)


def cmd_demo(args: argparse.Namespace) -> int:
    with _needs_runtime("kvc demo"):
        from composer.demo import main as demo_main
    return demo_main(args.file)


def cmd_simulate(args: argparse.Namespace) -> int:
    from composer import simulate as sim

    pipeline = _load(args.file, discover())
    try:
        if args.bytes_per_block is not None:
            try:
                bpb = int(TypeAdapter(ByteSize).validate_python(args.bytes_per_block))
            except ValidationError:
                raise CommandError(
                    f"--bytes-per-block: not a size: {args.bytes_per_block!r} (e.g. 2MiB)"
                ) from None
        elif args.model_config is not None:
            bpb = sim.bytes_per_block_from_config(args.model_config, args.block_size)
        else:
            raise CommandError("kvc simulate needs --bytes-per-block or --model-config")
        trace = sim.read_trace(args.trace)
        kwargs: dict[str, Any] = {
            "bytes_per_block": bpb,
            "block_size": args.block_size,
            "trace_block_tokens": args.trace_block_tokens,
            "vllm_cache_blocks": args.vllm_cache_blocks,
            "trace_name": os.path.basename(args.trace),
            "exact": args.exact,
        }
        if args.sweep is None:
            result = sim.simulate(pipeline, trace, **kwargs)
            text = _dump(result.as_dict()) if args.json else sim.format_result(result)
        else:
            name, values = sim.parse_sweep(args.sweep)
            results = sim.sweep(pipeline, trace, name, values, **kwargs)
            png = Path(args.output).with_suffix(".png") if args.output else Path(
                "kvc-simulate-sweep.png"
            )
            sim.plot_sweep(png, name, values, results)
            print(f"wrote {png}", file=sys.stderr)
            text = (
                _dump({"sweep": name, "values": values, "plot": str(png),
                       "results": [r.as_dict() for r in results]})
                if args.json
                else sim.format_sweep(name, values, results)
            )
    except sim.TraceError as exc:
        print(escape(str(exc)), file=sys.stderr)
        return EXIT_INVALID
    except (sim.SimulateError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    if args.output:
        try:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    else:
        print(text)
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from composer import replay
    from composer import simulate as sim

    try:
        trace = sim.read_trace(args.trace, limit=args.limit)
    except sim.TraceError as exc:
        print(escape(str(exc)), file=sys.stderr)
        return EXIT_INVALID
    try:
        replay.trace_block_tokens(args.scale)  # refused before any server starts
        if (args.model is None) == (args.url is None):
            raise replay.BenchError("kvc bench needs exactly one of --model and --url")
        if args.url is not None and args.config:
            raise replay.BenchError("--config starts servers: give --model, not --url")
        configs = [replay.Config.parse(c) for c in (args.config or ["none", "prefix"])]
        if args.pipeline_prefix_cache == "off":
            configs = [
                replay.Config(c.name, c.pipeline, prefix_caching=False) if c.pipeline else c
                for c in configs
            ]
        server = None
        if args.model is not None:
            server = replay.ServerSpec(
                model=args.model,
                block_size=args.block_size,
                max_model_len=args.max_model_len,
                num_blocks=args.num_gpu_blocks,
                kv_cache_gib=args.kv_cache_gib,
                extra_args=list(args.vllm_arg or []),
            )
        spec = replay.BenchSpec(
            trace=trace,
            configs=configs,
            server=server,
            url=args.url,
            scale=args.scale,
            concurrency=args.concurrency,
            speedup=args.speedup,
            max_output_tokens=args.max_output_tokens,
            vocab_size=args.vocab_size,
            workdir=Path(args.output),
            progress=not args.no_progress,
            rounds=args.rounds,
        )
        results = replay.run(spec)
        written = replay.write_report(results, spec.workdir, plot=not args.no_plot)
    except replay.BenchError as exc:
        raise CommandError(str(exc)) from None
    if args.json:
        print(_dump([r.summary() for r in results]))
    else:
        print(replay.markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return EXIT_OK


def cmd_top(args: argparse.Namespace) -> int:
    from composer import top

    if args.interval <= 0:
        raise CommandError(f"--interval must be > 0, got {args.interval}")
    try:
        return top.run(args.url, interval=args.interval, once=args.once)
    except OSError as exc:
        raise CommandError(f"cannot scrape {args.url}: {exc}") from None


@contextlib.contextmanager
def _needs_runtime(what: str) -> Iterator[None]:
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


# --------------------------------------------------------------------------- #
# parser and entry point
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvc",
        description="KV Composer: compose vLLM KV-cache connectors from a validated YAML "
        "graph of plugins.",
        epilog="Exit codes: 0 ok, 1 environment problem (e.g. vLLM missing), "
        "2 invalid pipeline or usage.",
    )
    parser.add_argument(
        "--json", action="store_true", help="machine-readable output where a command has it"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str) -> Any:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    def add_json(p: argparse.ArgumentParser) -> None:
        # SUPPRESS keeps a global `kvc --json validate` from being reset by the subcommand.
        p.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="JSON output"
        )

    p = add("validate", cmd_validate, "Validate pipeline files; report every problem.")
    p.epilog = (
        f"Limits (each reported where it is crossed): files of at most {MAX_FILE_BYTES:,} "
        f"bytes, regular files or stdin only; nesting at most {MAX_DEPTH} levels; at most "
        f"{MAX_VALUES:,} values once aliases are expanded; numbers of at most "
        f"{MAX_NUMBER_CHARS} characters."
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="pipeline YAML file ('-' for stdin)")
    p.add_argument(
        "--deep",
        action="store_true",
        help=(
            "also import every node class (per vLLM process) and check it against the hook "
            "spec, and vLLM-native connector names against the installed vLLM (imports the "
            "plugins' runtime modules, and vLLM when the pipeline has vllm nodes)"
        ),
    )
    add_json(p)

    p = add("graph", cmd_graph, "Draw a pipeline: nodes, roles, needs, load order, save targets.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--format", choices=("text", "mermaid"), default="text")
    add_json(p)

    p = add("plugins", cmd_plugins, "List installed plugin types and their config options.")
    add_json(p)

    p = add("schema", cmd_schema, "Write the pipeline JSON Schema (installed plugins included).")
    p.add_argument(
        "--output", "-o", metavar="DIR", help=f"write DIR/{SCHEMA_FILE} instead of printing"
    )

    p = add("export", cmd_export, "Print the JSON for vLLM's --kv-transfer-config.")
    p.add_argument("file", metavar="FILE")
    p.add_argument(
        "--reference",
        action="store_true",
        help="point vLLM at the file's absolute path instead of inlining the pipeline",
    )

    p = add("serve", cmd_serve, "Run `vllm serve` with this pipeline as its KV connector.")
    p.add_argument("file", metavar="FILE")
    p.add_argument(
        "vllm_args",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_ARGS",
        help="arguments for `vllm serve`, after --, e.g. -- MODEL --max-model-len 512",
    )

    p = add(
        "simulate",
        cmd_simulate,
        "Predict each node's hit rate on a request trace (no engine; torch and vLLM not needed).",
    )
    p.epilog = (
        "Semantics: requests replay in trace order, one at a time. A request's hit is its "
        "longest run of leading blocks present in the serving tier, counted after vLLM's own "
        "prefix-cache hit (--vllm-cache-blocks); only full blocks are cached; at least one "
        "prompt token is always computed; nodes are asked in load_order and load_policy picks "
        "the server; a tier stores a request's blocks, by its save policy, when the request "
        "finishes. Trace: Mooncake JSONL, one hash id per 512 prompt tokens; the partial last "
        "block and the output are unique to their request. Nodes whose plugin has no model are "
        "shown as not modelled and never hit."
    )
    p.add_argument("file", metavar="PIPELINE")
    p.add_argument("trace", metavar="TRACE", help="Mooncake-format JSONL trace")
    p.add_argument(
        "--bytes-per-block", metavar="SIZE",
        help="bytes of one KV block, all layers (e.g. 2MiB)",
    )
    p.add_argument(
        "--model-config", metavar="CONFIG_JSON",
        help="a Hugging Face config.json: bytes per block = layers x 2 x kv_heads x head_dim "
        "x dtype bytes x block size",
    )
    p.add_argument(
        "--block-size", type=int, default=32,
        help="vLLM's block size in tokens (default 32, as vLLM's CPU backend needs a "
        "multiple of 32; vLLM's GPU default is 16)",
    )
    p.add_argument(
        "--trace-block-tokens", type=int, default=512,
        help="tokens one trace hash id stands for (default 512, the trace's own); fewer "
        "rescales every length by the same factor, like a scaled replay",
    )
    p.add_argument(
        "--vllm-cache-blocks", type=int, default=0, metavar="N",
        help="model vLLM's own prefix cache of N blocks as a first tier (default 0: none)",
    )
    p.add_argument(
        "--exact", action="store_true",
        help="replay every vLLM block; by default, when the block size divides a trace "
        "block, whole trace blocks move as one unit (much faster; see the README)",
    )
    p.add_argument(
        "--sweep", metavar="FIELD=V1,V2,...",
        help="run once per value of a config field of every modelled node, e.g. "
        "capacity=1GiB,4GiB,16GiB: a table and a PNG plot",
    )
    p.add_argument(
        "--output", "-o", metavar="FILE",
        help="write the report to FILE; a sweep's plot goes to FILE with suffix .png "
        "(default kvc-simulate-sweep.png)",
    )
    add_json(p)

    p = add(
        "bench",
        cmd_bench,
        "Replay a request trace against real vLLM servers: TTFT, latency, throughput, "
        "prompt tokens served per node, for several configurations side by side.",
    )
    p.epilog = (
        "Each hash id of the trace becomes a fixed block of 512/--scale token ids (the same id "
        "always the same tokens); the partial last block is unique to its request, as in kvc "
        "simulate --trace-block-tokens 512/SCALE. Configurations: 'none' (no connector, no "
        "prefix cache), 'prefix' (vLLM's prefix cache only), or a pipeline file (kvc serve, "
        "prefix cache on unless --pipeline-prefix-cache off). Writes OUTPUT/bench.md, "
        "OUTPUT/bench.json and OUTPUT/ttft-cdf.png."
    )
    p.add_argument("trace", metavar="TRACE", help="Mooncake-format JSONL trace")
    p.add_argument(
        "--config", action="append", metavar="CONFIG",
        help="none, prefix or a pipeline file; repeat for several (default: none and prefix)",
    )
    p.add_argument("--model", help="model for the servers this command starts")
    p.add_argument("--url", help="a running server to target instead (one configuration)")
    p.add_argument(
        "--scale", type=int, default=16,
        help="divide every length by this (512 tokens per hash id become 512/SCALE; default 16)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--concurrency", type=int, metavar="N",
        help="keep N requests in flight, in trace order (default: the trace's arrival times)",
    )
    group.add_argument(
        "--speedup", type=float, default=1.0,
        help="send at the trace's arrival times divided by this (default 1)",
    )
    p.add_argument("--limit", type=int, metavar="N", help="the first N requests of the trace")
    p.add_argument(
        "--max-output-tokens", type=int, metavar="N", help="cap every request's output"
    )
    p.add_argument("--block-size", type=int, default=32, help="vLLM's block size (default 32)")
    p.add_argument(
        "--max-model-len", type=int, default=4096,
        help="vLLM's max model length; longer requests are skipped and counted (default 4096)",
    )
    p.add_argument(
        "--num-gpu-blocks", type=int, metavar="N",
        help="size vLLM's own KV cache to N blocks (--num-gpu-blocks-override), so that it "
        "overflows",
    )
    p.add_argument(
        "--kv-cache-gib", type=float, default=1,
        help="VLLM_CPU_KVCACHE_SPACE for the servers (default 1)",
    )
    p.add_argument(
        "--pipeline-prefix-cache", choices=("on", "off"), default="on",
        help="vLLM's prefix cache with pipeline configurations (default on)",
    )
    p.add_argument(
        "--vllm-arg", action="append", metavar="ARG",
        help="one more argument for every vllm serve (repeat; e.g. --vllm-arg=--enforce-eager)",
    )
    p.add_argument(
        "--vocab-size", type=int,
        help="token ids to draw from (default: the model directory's config.json)",
    )
    p.add_argument(
        "--output", "-o", default="kvc-bench", metavar="DIR",
        help="directory for the table, the JSON and the plot (default kvc-bench)",
    )
    p.add_argument(
        "--rounds", type=int, default=1, metavar="N",
        help="run the configurations N times in alternating order (ABC, CBA, ...) and pool "
        "each one's requests, so that a machine's drifting load favours none (default 1)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="no PNG (no matplotlib needed)")
    add_json(p)

    p = add(
        "top",
        cmd_top,
        "Live view of a running server's KV Composer nodes (hits, hit rate, bytes/s, pool use).",
    )
    p.add_argument("url", metavar="URL", help="the server's base URL or its /metrics URL")
    p.add_argument(
        "--interval", type=float, default=2.0, help="seconds between scrapes (default 2)"
    )
    p.add_argument(
        "--once", action="store_true",
        help="print one view (two scrapes INTERVAL apart, for the rates) and exit",
    )

    p = add("demo", cmd_demo, "Serve a tiny local model through a composed pipeline.")
    p.add_argument("file", nargs="?", metavar="FILE", help="pipeline to use (default: built in)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # A name the terminal's encoding cannot show is written as an escape, not a crash.
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_INVALID
    if args.verbose or args.command in ("serve", "demo"):
        # Only commands that run plugins log; structlog's import is most of
        # `kvc validate`'s start-up, so the others never configure it.
        configure(level={0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG))
    try:
        return int(args.func(args))
    except PipelineInvalid as exc:
        _print_problems(exc.problems, sys.stderr)
        return EXIT_INVALID
    except CommandError as exc:
        print(f"kvc: error: {escape(str(exc))}", file=sys.stderr)
        return EXIT_INVALID
    except (
        MissingRuntime, PluginConflict, PluginLoadError, pluggy.PluginValidationError
    ) as exc:
        print(f"kvc: error: {escape(str(exc))}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; say nothing more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
