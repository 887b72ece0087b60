"""Ahead-of-time compilation for GPU targets on a CPU (needs the ``aot`` extra)."""

from jtbo.aot.target import H200, GpuTarget, target_config_text
from jtbo.aot.topology import AotUnavailableError, aot_available, gpu_mesh, gpu_topology

__all__ = [
    "H200",
    "AotUnavailableError",
    "GpuTarget",
    "aot_available",
    "gpu_mesh",
    "gpu_topology",
    "target_config_text",
]
