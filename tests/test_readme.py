"""README.md's quickstart, the first Python block, runs as written: saved as a script in a
temporary folder and run there by this interpreter, as a user would (no ``JAX_PLATFORMS`` or
``XLA_FLAGS``: the block's own ``jtbo.configure_platform`` chooses the platform)."""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jtbo.info import platform

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _first_python_block() -> str:
    match = re.search(r"^```python\n(.*?)^```$", README.read_text(), re.MULTILINE | re.DOTALL)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_the_quickstart_runs_as_written_from_another_folder(tmp_path):
    if platform.nvidia_gpu_present():
        pytest.skip("the quickstart's 8-device mesh runs on the CPU or on 8 GPUs")
    script = tmp_path / "quickstart.py"
    script.write_text(_first_python_block())
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    results = ast.literal_eval(run.stdout.strip().splitlines()[-1])  # a list of lists
    assert [len(tokens) for tokens in results] == [16, 16]
    assert all(isinstance(token, int) for tokens in results for token in tokens)
