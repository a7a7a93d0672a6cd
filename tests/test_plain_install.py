"""A plain install (numpy and threadpoolctl only, no extras) imports and trains.

Building a fresh virtual environment is too slow for the suite, so each check runs in a
subprocess where the optional packages cannot be imported (``sys.modules[name] = None``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("grpc", "msgpack", "uvloop", "matplotlib", "tqdm", "torch", "cupy")


def _run_without(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys\nfor _name in {blocked!r}:\n    sys.modules[_name] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_single_model_example_trains_without_any_extra() -> None:
    result = _run_without(
        OPTIONAL,
        "import runpy\n"
        "sys.argv = ['demo', '--steps', '60']\n"
        "runpy.run_module('aioautograd.examples.demo', run_name='__main__')\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    steps = re.findall(r"step\s+(\d+)\s+loss ([\d.]+)\s+accuracy\s+([\d.]+)%", result.stdout)
    assert len(steps) >= 2, result.stdout
    first_loss, last_loss = float(steps[0][1]), float(steps[-1][1])
    assert int(steps[-1][0]) == 60
    assert last_loss < 0.5 * first_loss
    assert float(steps[-1][2]) > 80.0


def test_distributed_without_the_extra_names_it() -> None:
    result = _run_without(("grpc", "msgpack"), "import aioautograd.distributed\n")
    assert result.returncode != 0
    assert "pip install 'aioautograd[distributed]'" in result.stderr
    # The core keeps working in the same situation.
    core = _run_without(
        ("grpc", "msgpack"), "import aioautograd; print(aioautograd.randn(2).shape)"
    )
    assert core.returncode == 0, core.stderr
    assert "(2,)" in core.stdout


def test_grpc_backend_without_grpcio_names_the_extra() -> None:
    result = _run_without(
        ("grpc",), "from aioautograd.distributed.rpc.backends import grpc  # noqa: F401\n"
    )
    assert result.returncode != 0
    assert "grpcio" in result.stderr
    assert "pip install 'aioautograd[distributed]'" in result.stderr


def test_package_metadata_builds_without_warnings(tmp_path: Path) -> None:
    # What pip runs to install the project: any setuptools warning (such as the deprecated
    # license table) would be printed on every install.
    pytest.importorskip("setuptools")
    result = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-c",
            "import setuptools; setuptools.setup()",
            "-q",
            "egg_info",
            "--egg-base",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in (result.stdout + result.stderr).lower()
    (info,) = tmp_path.glob("*.egg-info")
    requires = (info / "requires.txt").read_text()
    core = requires.split("\n[", 1)[0].split()
    assert sorted(name.split(">")[0] for name in core) == ["numpy", "threadpoolctl"]
    for extra in ("[distributed]", "[uvloop]", "[test]", "[dev]", "[notebook]"):
        assert extra in requires


def test_editable_install_builds_without_warnings(tmp_path: Path) -> None:
    # `make test` and `make demo` install the checkout in editable mode; pip shows the build
    # backend's warnings. Built from a copy, so that nothing is written into the checkout.
    pytest.importorskip("setuptools")
    project = tmp_path / "project"
    shutil.copytree(ROOT / "aioautograd", project / "aioautograd", ignore=_ignored)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    code = "import sys; from setuptools import build_meta; build_meta.build_editable(sys.argv[1])"
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code, str(wheels)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=project,
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower()
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (pth,) = [name for name in archive.namelist() if name.endswith(".pth")]
        assert archive.read(pth).decode().strip() == str(project.resolve())


def _ignored(directory: str, names: list[str]) -> list[str]:
    return [name for name in names if name == "__pycache__"]
