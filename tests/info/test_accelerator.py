"""The GPU / CPU set-up choice, with a fake ``nvidia-smi`` on PATH."""

import subprocess
import sys

import pytest

from jtbo.info import accelerator

LISTING = "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)\n"


def _fake_smi(folder, monkeypatch, stdout: str, code: int = 0) -> None:
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '%s' '{stdout}'\nexit {code}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))


def test_a_listed_gpu_chooses_the_gpu_set_up(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, LISTING)
    detection = accelerator.detect_accelerator()
    assert detection == accelerator.Detection("gpu", "nvidia-smi -L lists 2 GPU(s)")
    assert "cuda12" in accelerator.install_extras(detection.accelerator)


def test_no_nvidia_smi_chooses_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # empty folder: no nvidia-smi
    detection = accelerator.detect_accelerator()
    assert detection.accelerator == "cpu" and "no nvidia-smi" in detection.reason
    assert accelerator.install_extras("cpu") == ("test", "aot")


@pytest.mark.parametrize(("stdout", "code"), [("", 0), ("No devices were found\n", 6)])
def test_a_failing_or_empty_nvidia_smi_chooses_the_cpu(tmp_path, monkeypatch, stdout, code):
    _fake_smi(tmp_path, monkeypatch, stdout, code)
    assert accelerator.detect_accelerator().accelerator == "cpu"


def test_gpu_flag_forces_the_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert accelerator.detect_accelerator("1").accelerator == "gpu"
    _fake_smi(tmp_path, monkeypatch, LISTING)
    assert accelerator.detect_accelerator("0") == accelerator.Detection("cpu", "forced by GPU=0")
    with pytest.raises(ValueError, match="gpu must be"):
        accelerator.detect_accelerator("yes")
    with pytest.raises(ValueError, match="accelerator must be"):
        accelerator.install_extras("tpu")


def test_the_makefile_command_runs_without_jax(tmp_path):
    """``python -m jtbo.info.accelerator`` imports no jax (the Makefile runs it first)."""
    code = (
        "import sys, runpy; sys.argv = ['x', '--gpu', '1', '--print', 'extras'];"
        "runpy.run_module('jtbo.info.accelerator', run_name='__main__')"
    )
    probe = f"{code}\n"
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", probe + "print('jax' in sys.modules)"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr  # runpy's SystemExit(0) ends the program
    assert out.stdout.strip() == "test,aot,cuda12"
