"""Meshes of GPUs that are not there: an N x H200 host described to XLA from a CPU.

Requires the ``aot`` extra (``jax-cuda12-plugin`` at the installed jax version) and a
process started with ``JAX_PLATFORMS=cpu``: without it the plugin tries to initialise
CUDA and fails on a machine with no GPU.
"""

import functools

import jax
from jax.experimental import topologies

from jtbo.aot import target as target_lib


class AotUnavailableError(RuntimeError):
    """Raised when GPU programs cannot be compiled on this machine."""


@functools.cache
def gpu_topology(num_devices: int, target: target_lib.GpuTarget = target_lib.H200):
    """Returns the topology description of one host with ``num_devices`` GPUs.

    Args:
      num_devices: GPUs on the host (1 to 8).
      target: the GPU's figures.

    Returns:
      A ``jax`` topology description whose devices compile for ``target``.

    Raises:
      AotUnavailableError: the CUDA plugin is not installed or cannot describe the target.
    """
    try:
        return topologies.get_topology_desc(
            platform="cuda",
            target_config=target_lib.target_config_text(target),
            topology=f"1x1x{num_devices}",
        )
    except Exception as error:  # the plugin raises several types; name the cause
        raise AotUnavailableError(
            "cannot describe a CUDA topology on this machine: install the `aot` extra "
            "(jax-cuda12-plugin at jax's version) and run with JAX_PLATFORMS=cpu; "
            f"cause: {error!r}"
        ) from error


def gpu_mesh(
    axis_sizes: tuple[int, ...],
    axis_names: tuple[str, ...],
    target: target_lib.GpuTarget = target_lib.H200,
) -> jax.sharding.Mesh:
    """Returns a mesh over a host of ``prod(axis_sizes)`` described GPUs.

    Args:
      axis_sizes: size of each mesh axis.
      axis_names: name of each mesh axis.
      target: the GPU's figures.

    Returns:
      A mesh whose devices exist only for compilation (``.lower(...).compile()``).
    """
    num_devices = 1
    for size in axis_sizes:
        num_devices *= size
    topology = gpu_topology(num_devices, target)
    return topologies.make_mesh(topology, axis_sizes, axis_names)


def aot_available() -> bool:
    """Whether GPU programs can be compiled here (for skipping optional reports)."""
    try:
        gpu_topology(1)
    except AotUnavailableError:
        return False
    return True
