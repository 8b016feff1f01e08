"""``kvc serve FILE -- <vllm serve args>``: ``vllm serve`` with the pipeline as its connector."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from composer.errors import PipelineInvalid
from composer.export import kv_transfer_config
from composer.validation import load_pipeline


def vllm_command() -> list[str]:
    # vLLM's own CLI, through a shim that also works with the CPU build's dist name.
    return [sys.executable, "-m", "composer.vllm.cli"]


def serve_command(file: str, vllm_args: list[str]) -> list[str]:
    """The ``vllm serve`` command line for ``file`` (validated first; raises PipelineInvalid)."""
    pipeline = load_pipeline(file)
    # Pass the file by absolute path: vLLM's processes re-read and re-validate it.
    config = kv_transfer_config(pipeline, reference=Path(file).resolve())
    return [*vllm_command(), "serve", *vllm_args, "--kv-transfer-config", json.dumps(config)]


def serve(file: str, vllm_args: list[str]) -> int:
    """Validate ``file``, then become ``vllm serve`` (returns only on invalid input).

    Replacing this process instead of running a child leaves vLLM's own
    signal handling intact: SIGTERM or Ctrl-C reach the API server directly,
    which then stops its engine gracefully (shared memory unlinked, workers
    joined), and its exit status is the command's.
    """
    try:
        command = serve_command(file, vllm_args)
    except PipelineInvalid as exc:
        print(exc, file=sys.stderr)
        return 2
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(command[0], command)
