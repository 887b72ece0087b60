"""``python -m jtbo.info`` run as a user runs it: on a host without an NVIDIA GPU it chooses the
CPU first, so its output holds the report and no traceback (the CUDA plugin is not tried)."""

import os
import subprocess
import sys

import pytest

from jtbo.info import platform


def test_the_report_runs_without_a_traceback(tmp_path):
    if platform.nvidia_gpu_present():
        pytest.skip("checks the platform choice on a host without an NVIDIA GPU")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    run = subprocess.run([sys.executable, "-m", "jtbo.info"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "| cpu x1 |" in lines[0]
    assert lines[1] == f"jax platform: cpu (no {platform.NVIDIA_DEVICE_NODE}: no NVIDIA GPU here)"
    assert "\ndevices:\n" in run.stdout
