"""``import composer``, ``kvc validate`` and ``kvc --help`` must not import torch or vLLM (and the
two commands not structlog either).

They run in fresh interpreters: this test process may have imported anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "vllm", "transformers")

PROBE = """
import sys
{body}
print("HEAVY=" + ",".join(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _heavy_after(body: str, cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(body=body, heavy=HEAVY)],
        capture_output=True,
        text=True,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr
    (marker,) = [line for line in proc.stdout.splitlines() if line.startswith("HEAVY=")]
    return marker.removeprefix("HEAVY=")


@pytest.mark.parametrize(
    "body",
    [
        "import composer",
        "import composer.cli, composer.validation.deep_check, composer.export, composer.hookspecs"
        ", composer.hook_table",
        # The plugin API's namespaces a plugin's light modules import.
        "import composer.servers\nfrom composer import *",
        # Every example, so the installed plugins' entry-point modules are checked too.
        "from composer.cli import main\n"
        "import glob\n"
        "assert main(['validate', *sorted(glob.glob('examples/*.yaml'))]) == 0",
        "from composer.cli import main\nassert main(['--help']) == 0",
        "from composer.cli import main\nassert main(['plugins']) == 0",
        "from composer.cli import main\nassert main(['schema']) == 0",
        "from composer.cli import main\n"
        "assert main(['graph', 'examples/offload-before-nixl.yaml']) == 0\n"
        "assert main(['export', 'examples/cpu-offload.yaml']) == 0",
        # --model reads config.json only; every plugin's model_support runs (lmcache refuses).
        "from composer.cli import main\n"
        "import glob, json, pathlib, tempfile\n"
        "d = pathlib.Path(tempfile.mkdtemp())\n"
        "(d / 'config.json').write_text(json.dumps({'model_type': 'gemma3_text', "
        "'num_hidden_layers': 2, 'num_attention_heads': 4, 'hidden_size': 128, "
        "'sliding_window': 64, 'layer_types': ['sliding_attention', 'full_attention']}))\n"
        "assert main(['validate', *sorted(glob.glob('examples/*.yaml')), '--model', str(d)]) == 2\n"
        "assert main(['graph', 'examples/cpu-offload.yaml', '--model', str(d)]) == 0\n"
        "assert main(['validate', '--help']) == 0",
    ],
    ids=[
        "import", "modules", "plugin-api", "validate", "help", "plugins", "schema",
        "graph-export", "model",
    ],
)
def test_light(body: str, root: Path) -> None:
    assert _heavy_after(body, root) == ""


def test_probe_sees_heavy_imports(root: Path) -> None:
    # Guards the test above against passing vacuously.
    assert _heavy_after("import json, torch", root) == "torch"


@pytest.mark.parametrize("argv", [["--help"], ["validate", "examples/cpu-offload.yaml"]])
def test_console_script_import_profile(argv: list[str], root: Path, kvc: str) -> None:
    """The installed ``kvc`` script itself, through Python's own import profiler."""
    proc = subprocess.run(
        [kvc, *argv],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "composer.cli" in imported
    assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == []
    # Nor structlog: it costs more than the rest of either (only a command that has
    # something to log imports it).
    assert "structlog" not in imported
