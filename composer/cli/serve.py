"""``kvc serve FILE -- <vllm serve args>``: ``vllm serve`` with the pipeline as its connector."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from composer.errors import PipelineInvalid
from composer.export import kv_transfer_config
from composer.loader import file_marks
from composer.pipeline import ResolvedPipeline
from composer.servers.loopback import LOOPBACK, free_port
from composer.servers.valkey import ValkeyError, ValkeyServer, valkey_server_binary
from composer.servers.vllm_serve import vllm_command
from composer.validation import load_pipeline
from composer.validation.deep_check import sleep_mode_problems


def serve_command(file: str, vllm_args: list[str], kv_role: str | None = None) -> list[str]:
    """The ``vllm serve`` command line for ``file`` (validated first, for the P/D side
    ``kv_role`` when given; raises PipelineInvalid)."""
    pipeline = load_pipeline(file, kv_role=kv_role)
    if sleep_mode_asked(vllm_args):
        refuse_sleep_mode(pipeline, file)
    # Pass the file by absolute path: vLLM's processes re-read and re-validate it.
    config = kv_transfer_config(pipeline, reference=Path(file).resolve())
    return [*vllm_command(), "serve", *vllm_args, "--kv-transfer-config", json.dumps(config)]


def serve(
    file: str, vllm_args: list[str], *, valkey: bool = False, kv_role: str | None = None
) -> int:
    """Validate ``file``, then become ``vllm serve`` (returns only on invalid input).

    Replacing this process instead of running a child leaves vLLM's own
    signal handling intact: SIGTERM or Ctrl-C reach the API server directly,
    which then stops its engine gracefully (shared memory unlinked, workers
    joined), and its exit status is the command's. With ``valkey``, a local
    ``valkey-server`` is started first; the kernel stops it when the server ends.
    """
    problem = kv_events_problem(vllm_args, os.environ)
    if problem:
        print(f"kvc serve: {problem}", file=sys.stderr)
        return 2
    store = None
    if valkey:
        try:
            store = _start_valkey()
        except ValkeyError as exc:
            print(f"kvc serve --valkey: {exc}", file=sys.stderr)
            return 1
    try:
        command = serve_command(file, vllm_args, kv_role)
    except PipelineInvalid as exc:
        print(exc, file=sys.stderr)
        if store is not None:
            store.stop()
        return 2
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(command[0], command)


def sleep_mode_asked(vllm_args: list[str]) -> bool:
    """Whether these ``vllm serve`` arguments turn sleep mode on (the last flag wins)."""
    asked = False
    for arg in vllm_args:
        name, _, value = arg.partition("=")
        name = name.replace("_", "-")
        if name == "--enable-sleep-mode":
            asked = value.lower() not in ("false", "0", "no")
        elif name == "--no-enable-sleep-mode":
            asked = False
    return asked


def refuse_sleep_mode(pipeline: ResolvedPipeline, file: str) -> None:
    """Raise PipelineInvalid, each node located, if the pipeline cannot sleep: vLLM
    0.33 would refuse it only at engine start ("ComposedConnector does not support
    sleep mode"), and vLLM 0.32 would not refuse it at all."""
    # vLLM itself, imported only for --enable-sleep-mode (it starts right after).
    from composer.vllm.pipeline_source import sleep_mode_refusals

    problems = sleep_mode_problems(pipeline, sleep_mode_refusals(pipeline), marks=file_marks(file))
    if problems:
        raise PipelineInvalid(problems)


def kv_events_problem(vllm_args: list[str], env: Mapping[str, str]) -> str:
    """Why these ``vllm serve`` arguments would publish KV events a fleet cannot use
    ("" if none). With a non-cryptographic prefix-caching hash (``xxhash``,
    ``xxhash_cbor``) and no ``PYTHONHASHSEED``, vLLM seeds its block hashes with
    random bytes per process, so two engines, or an engine and a router, would
    hash one prompt apart (sha256, the default, has a fixed seed)."""
    events, algo = False, "sha256"
    for i, arg in enumerate(vllm_args):
        name, _, value = arg.partition("=")
        name = name.replace("_", "-")
        if name == "--kv-events-config":
            events = True
        elif name == "--prefix-caching-hash-algo":
            algo = value or (vllm_args[i + 1] if i + 1 < len(vllm_args) else "")
    if not events or not algo.startswith("xxhash") or env.get("PYTHONHASHSEED") is not None:
        return ""
    return (
        f"--kv-events-config with --prefix-caching-hash-algo {algo} publishes block hashes "
        "that vLLM seeds with random bytes per process when PYTHONHASHSEED is unset: set "
        "PYTHONHASHSEED to the same value for every engine of the fleet (e.g. "
        "PYTHONHASHSEED=0), so that a router's index and each engine hash a prompt alike"
    )


def _start_valkey() -> ValkeyServer:
    """A valkey-server on loopback at a free port, for this server's lifetime; its
    address in ``VALKEY_HOST`` / ``VALKEY_PORT`` (read by the pipeline file)."""
    store = ValkeyServer(
        host=LOOPBACK,
        port=free_port(),
        workdir=Path(tempfile.mkdtemp(prefix="kvc-valkey-")),
        binary=valkey_server_binary(),
        die_with_parent=True,
    ).start()
    os.environ["VALKEY_HOST"], os.environ["VALKEY_PORT"] = store.host, str(store.port)
    print(
        f"+ valkey-server on {store.host}:{store.port} (pid {store.pid}; stops with this "
        "server): VALKEY_HOST, VALKEY_PORT set",
        file=sys.stderr,
        flush=True,
    )
    return store
