"""The ``python -m jtbo.info`` report and the one-line summary the demo and benches print."""

import dataclasses
import os
import platform
import sys
from collections.abc import Callable

from jtbo.info import accelerator, devices, kernel_impls, nccl, packages

ENV_VARS = ("JAX_PLATFORMS", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS")


@dataclasses.dataclass(frozen=True)
class Section:
    """A titled block of the report."""

    title: str  # e.g. "packages"
    lines: tuple[str, ...]  # the block's lines, without indentation


def _backend_lines(read: Callable[[], list[str]]) -> list[str]:
    """``read()``, or one line saying why jax could not start a backend."""
    try:
        return read()
    except RuntimeError as err:
        return [f"not available: jax could not start a backend ({err})"]


def _system_lines() -> list[str]:
    detection = accelerator.detect_accelerator()
    return [
        f"python {sys.version.split()[0]} ({sys.executable})",
        f"platform {platform.platform()}",
        f"accelerator set-up: {detection.accelerator} ({detection.reason})",
    ] + [f"{name}={os.environ.get(name, '(unset)')}" for name in ENV_VARS]


def sections() -> list[Section]:
    """Every section of the report; starts the jax backend for the device sections."""
    names = packages.CORE + packages.OPTIONAL
    return [
        Section("system", tuple(_system_lines())),
        Section("packages", tuple(packages.package(n).describe() for n in names)),
        Section("CUDA plugin", tuple(packages.plugin_lines())),
        Section("NCCL", tuple(nccl.nccl_lines())),
        Section("devices", tuple(_backend_lines(devices.device_lines))),
        Section("kernel impls", tuple(_backend_lines(kernel_impls.impl_lines))),
    ]


def render(blocks: list[Section]) -> str:
    """The sections as text: a title line, then the lines indented by two spaces."""
    out = []
    for block in blocks:
        out.append(f"{block.title}:")
        out.extend(f"  {line}" for line in block.lines)
    return "\n".join(out)


def summary_line(start_backend: bool = True) -> str:
    """One line: jtbo and jax versions, the devices and the kernel impls that run here.

    Args:
      start_backend: False for callers that still have to configure jax (``XLA_FLAGS``,
        NCCL variables, ``jax_num_cpu_devices``): the line then names no devices or impls.

    Returns:
      E.g. ``"jtbo 0.1.0 | jax 0.12.0.1 | cpu x8 | impls: xla, pallas(interpret)"``.
    """
    # Run from a checkout without installing, jtbo has no metadata: say so, not "jtbo None".
    head = f"{packages.package('jtbo').describe()} | {packages.package('jax').describe()}"
    if not start_backend:
        return f"{head} | devices: not started yet (jax is configured first)"
    where = _backend_lines(lambda: [devices.platform_phrase()])[0]
    impls = _backend_lines(lambda: [kernel_impls.available_phrase()])[0]
    return f"{head} | {where} | impls: {impls}"
