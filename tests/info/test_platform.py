"""``configure_platform``: the CPU where no NVIDIA GPU is present, kept choices, CPU devices.

The test process's jax has started, so the checks that the choice reaches an imported jax
and that a started backend is refused are each seen through a stand-in.
"""

import os
import subprocess
import sys

import jax
import pytest

from jtbo.info import platform


@pytest.fixture
def fresh(monkeypatch):
    """A process whose jax has not started: no JAX_PLATFORMS or XLA_FLAGS, the updates of an
    imported jax recorded instead of made."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(platform, "_backend_started", lambda: False)
    updates = []
    monkeypatch.setattr(platform, "_update_imported_jax", lambda *args: updates.append(args))
    return updates


def test_no_gpu_means_the_cpu_with_the_devices_asked_for(fresh, monkeypatch):
    monkeypatch.setattr(platform, "nvidia_gpu_present", lambda: False)
    choice = platform.configure_platform(cpu_devices=8)
    assert (choice.platform, choice.cpu_devices) == ("cpu", 8)
    assert "no NVIDIA GPU" in choice.reason
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert fresh == [("cpu", 8)]


def test_a_gpu_machine_is_left_to_jax(fresh, monkeypatch):
    monkeypatch.setattr(platform, "nvidia_gpu_present", lambda: True)
    choice = platform.configure_platform(cpu_devices=8)
    assert (choice.platform, choice.cpu_devices) == ("", None)
    assert "JAX_PLATFORMS" not in os.environ and "XLA_FLAGS" not in os.environ


def test_a_platform_and_device_count_already_set_are_kept(fresh, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--a=1 --xla_force_host_platform_device_count=4")
    choice = platform.configure_platform(cpu_devices=8)
    assert (choice.platform, choice.reason, choice.cpu_devices) == (
        "cpu", "JAX_PLATFORMS is set", 4,
    )  # fmt: skip
    assert os.environ["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=4"


def test_bad_counts_and_a_started_backend_are_refused():
    with pytest.raises(ValueError, match="cpu_devices must be >= 1, got 0"):
        platform.configure_platform(cpu_devices=0)
    jax.devices()  # starts this process's backend if no test before has
    with pytest.raises(RuntimeError, match="before jax starts its backend"):
        platform.configure_platform()


def test_a_fresh_process_gets_its_cpu_devices_without_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    script = (
        "import jax\nfrom jtbo.info import platform\nchoice = platform.configure_platform(4)\n"
        "print(choice.platform, len(jax.devices()), jax.devices()[0].platform)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    if platform.nvidia_gpu_present():
        pytest.skip("checks the CPU choice on a host without an NVIDIA GPU")
    assert run.stdout.split() == ["cpu", "4", "cpu"]
    assert "Traceback" not in run.stderr, run.stderr
