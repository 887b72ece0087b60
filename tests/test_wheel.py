"""The built wheel works outside the source tree (``python -m build``, then a fresh venv).

Catches package data missing from the wheel, modules that import test-only code and entry
points that only work from the checkout. Built once per run (module fixture; ``--dist
loadgroup`` keeps the module on one worker). The README's quickstart then runs from the wheel
as ``tests/test_readme.py`` runs it from the checkout (``readme_quickstart``): the same step
programs, compiled once in a run through its compilation cache.

The fresh venv gets the wheel with ``pip install --no-deps``; the dependencies (jax, jaxlib,
flax, ...: hundreds of MB) come from the checkout's venv through a ``.pth`` file that lists
its site-packages directory. A ``.pth`` line that is a path only appends that directory to
``sys.path`` after the fresh venv's own site-packages, and ``.pth`` files inside an appended
directory are not processed, so the checkout's editable-install hook stays off and ``jtbo``
can only come from the wheel (asserted below). A full install would download or unpack jax,
jaxlib and the CUDA plugin on every run. ``--system-site-packages`` is not used: it would
expose the base interpreter's packages, not the venv's.
"""

import os
import pathlib
import subprocess
import sys
import sysconfig
import tomllib
import venv

import pytest

from jtbo.bench import __main__ as bench_main
from jtbo.info import platform
from tests import readme_quickstart, xla_flags

pytestmark = pytest.mark.wheel

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(python: pathlib.Path, args: list[str], cwd: pathlib.Path, timeout: int = 300):
    """Runs ``python args`` in ``cwd`` on 8 CPU devices, without the checkout on any path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    flags = xla_flags.with_fast_compile("--xla_force_host_platform_device_count=8")
    env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    out = subprocess.run(
        [str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"{args}: rc {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _build(dist: pathlib.Path) -> pathlib.Path:
    """Builds the sdist, then the wheel from it (``python -m build``); returns the wheel."""
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(REPO)],
        cwd=dist, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("jtbo-*.whl")
    return wheel


def _fresh_venv(root: pathlib.Path, wheel: pathlib.Path) -> pathlib.Path:
    """A venv at ``root`` with the wheel installed and the checkout venv's dependencies."""
    venv.create(root, with_pip=False)
    python = root / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    site = _run(python, ["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root)
    deps = sysconfig.get_paths()["purelib"]  # the checkout venv's site-packages (pytest's)
    (pathlib.Path(site.strip()) / "jtbo_test_deps.pth").write_text(deps + "\n")
    return python


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of the fresh venv, a working directory outside the checkout, the dist dir)."""
    root = tmp_path_factory.mktemp("wheel")
    assert REPO not in root.parents, "the temp dir must lie outside the checkout"
    dist, cwd = root / "dist", root / "cwd"
    dist.mkdir()
    cwd.mkdir()
    python = _fresh_venv(root / "venv", _build(dist))
    return python, cwd, dist


def test_sdist_and_wheel_hold_every_package(installed):
    _, _, dist = installed
    (sdist,) = dist.glob("jtbo-*.tar.gz")
    packages = {p.parent.relative_to(REPO) for p in (REPO / "jtbo").rglob("__init__.py")}
    wheel_paths = _run(installed[0], ["-m", "zipfile", "-l", str(next(dist.glob("*.whl")))], dist)
    for package in packages:
        assert f"{package.as_posix()}/__init__.py" in wheel_paths, package
    assert sdist.stat().st_size > 0


def test_jtbo_imports_from_the_wheel_with_the_pyproject_version(installed):
    python, cwd, _ = installed
    out = _run(python, ["-c", "import jtbo; print(jtbo.__file__); print(jtbo.__version__)"], cwd)
    path, version = out.split()
    assert pathlib.Path(path).is_relative_to(python.parents[1]), path
    with open(REPO / "pyproject.toml", "rb") as f:
        assert version == tomllib.load(f)["project"]["version"]


def test_demo_bench_and_info_entry_points(installed):
    python, cwd, _ = installed
    assert "--expect-gpu" in _run(python, ["-m", "jtbo.demo", "--help"], cwd)
    bench_help = _run(python, ["-m", "jtbo.bench", "--help"], cwd)
    for name in bench_main._available():
        assert f"  {name}\n" in bench_help, name
    info = _run(python, ["-m", "jtbo.info"], cwd)
    assert "cpu x8" in info.splitlines()[0] and "kernel impls:" in info


def test_the_readme_quickstart_runs_from_the_wheel(installed):
    # The quickstart as the README test runs it, with the fresh venv's interpreter: jtbo (and
    # its imports of the top-level API) must come from the wheel.
    if platform.nvidia_gpu_present():
        pytest.skip("the quickstart's 8-device mesh runs on the CPU or on 8 GPUs")
    python, cwd, _ = installed
    epilogue = "\nprint('jtbo', jtbo.__file__)\n"
    results, out = readme_quickstart.run(python, cwd, epilogue)
    assert [len(tokens) for tokens in results] == [16, 16]
    (jtbo_file,) = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("jtbo ")]
    assert pathlib.Path(jtbo_file).is_relative_to(python.parents[1]), jtbo_file
