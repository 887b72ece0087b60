"""Choosing jax's platform before its backend starts: the CPU where no NVIDIA GPU is present.

jax tries every installed PJRT plugin when ``JAX_PLATFORMS`` is unset. The ``aot`` extra
installs the CUDA plugin without NVIDIA's libraries (it is there to compile 8xH200 programs
on a CPU), so on a machine without a GPU that attempt prints a traceback ("Unable to load
cuDNN") before jax settles on the CPU. ``configure_platform`` makes the choice jax would end
with, without the attempt: where ``JAX_PLATFORMS`` is unset and the machine has no NVIDIA
device node, it sets ``JAX_PLATFORMS=cpu``. On the CPU it can also ask for virtual devices,
so that a multi-device mesh runs on a laptop.

Imports only the standard library: entry points call it before anything imports jax.
"""

import dataclasses
import os
import sys

NVIDIA_DEVICE_NODE = "/dev/nvidiactl"  # present wherever the NVIDIA driver serves a GPU
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class PlatformChoice:
    """What ``configure_platform`` decided."""

    platform: str  # the JAX_PLATFORMS in effect ("" where jax picks, e.g. "cuda" or "cpu")
    reason: str  # why, e.g. "no /dev/nvidiactl: no NVIDIA GPU"
    cpu_devices: int | None  # virtual CPU devices asked for (None: jax's default of one)


def nvidia_gpu_present() -> bool:
    """Whether the NVIDIA driver's control node exists (a GPU can be used here)."""
    return os.path.exists(NVIDIA_DEVICE_NODE)


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # noqa: PLC0415 - jax is already imported

    return xla_bridge.backends_are_initialized()


def _ask_for_cpu_devices(count: int) -> int:
    """Sets the virtual CPU device count unless ``XLA_FLAGS`` already sets one; returns it."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in flags.split():
        if flag.startswith(f"{_DEVICE_COUNT_FLAG}="):
            return int(flag.split("=", 1)[1])
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()
    return count


def _update_imported_jax(platform: str, cpu_devices: int | None) -> None:
    """jax read ``JAX_PLATFORMS`` when it was imported: the choice goes to its config too."""
    import jax  # noqa: PLC0415 - only where jax is imported already

    if platform:
        jax.config.update("jax_platforms", platform)
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def _platform_and_reason() -> tuple[str, str]:
    given = os.environ.get("JAX_PLATFORMS")
    if given is not None:
        return given, "JAX_PLATFORMS is set"
    if nvidia_gpu_present():
        return "", f"{NVIDIA_DEVICE_NODE} exists: jax picks the GPU"
    os.environ["JAX_PLATFORMS"] = "cpu"
    return "cpu", f"no {NVIDIA_DEVICE_NODE}: no NVIDIA GPU here"


def configure_platform(cpu_devices: int | None = None) -> PlatformChoice:
    """Chooses jax's platform (and, on the CPU, its device count) before its backend starts.

    Where ``JAX_PLATFORMS`` is set it is kept; where it is unset and no NVIDIA GPU is
    present it becomes ``"cpu"``; on a GPU machine nothing changes. A device count already
    in ``XLA_FLAGS`` is kept too.

    Args:
      cpu_devices: on the CPU platform, how many virtual devices to give jax (a mesh of
        ``dp_size * attn_tp_size`` devices needs that many); None leaves jax's one device.

    Returns:
      The platform in effect and why.

    Raises:
      ValueError: ``cpu_devices`` below 1.
      RuntimeError: jax's backend has already started, so the choice would be ignored.
    """
    if cpu_devices is not None and cpu_devices < 1:
        raise ValueError(f"cpu_devices must be >= 1, got {cpu_devices}")
    if _backend_started():
        raise RuntimeError(
            "configure_platform must run before jax starts its backend "
            "(before the first jax.devices() call or computation)"
        )
    platform, reason = _platform_and_reason()
    count = None
    if cpu_devices is not None and platform == "cpu":
        count = _ask_for_cpu_devices(cpu_devices)
    if "jax" in sys.modules:
        _update_imported_jax(platform, count)
    return PlatformChoice(platform, reason, count)
