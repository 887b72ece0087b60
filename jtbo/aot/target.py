"""GPU compile targets described from published figures, for compiling on a CPU.

XLA can compile a program for a GPU it does not have: the CUDA PJRT plugin takes a
``GpuTargetConfig`` text proto describing the device. jtbo carries the NVIDIA H200's
description here (figures from NVIDIA's H200 / Hopper datasheets) so a CPU-only machine,
CI included, can compile a multi-GPU step and inspect the schedule XLA's latency-hiding
scheduler produces for it.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU's figures as XLA's ``GpuTargetConfig`` needs them."""

    name: str  # device_description_str, e.g. "NVIDIA H200"
    sm_count: int  # streaming multiprocessors
    compute_capability: tuple[int, int]  # (major, minor)
    memory_bandwidth_bytes_per_s: int  # HBM bandwidth
    l2_cache_bytes: int
    device_memory_bytes: int
    clock_rate_ghz: float  # boost clock
    fp32_lanes_per_sm: int  # CUDA cores per SM
    shared_memory_per_sm_bytes: int  # configurable shared memory per SM
    shared_memory_per_block_optin_bytes: int  # max opt-in shared memory per block
    registers_per_sm: int  # 32-bit registers per SM
    cudnn_version: tuple[int, int, int]  # assumed cuDNN for the compile


H200 = GpuTarget(
    name="NVIDIA H200",
    sm_count=132,
    compute_capability=(9, 0),
    memory_bandwidth_bytes_per_s=4_800_000_000_000,
    l2_cache_bytes=50 * 1024 * 1024,
    device_memory_bytes=141 * 1024**3,
    clock_rate_ghz=1.98,
    fp32_lanes_per_sm=128,
    shared_memory_per_sm_bytes=228 * 1024,
    shared_memory_per_block_optin_bytes=227 * 1024,
    registers_per_sm=65536,
    cudnn_version=(9, 10, 0),
)


def target_config_text(target: GpuTarget = H200) -> str:
    """Renders ``target`` as the ``GpuTargetConfig`` text proto XLA's CUDA plugin reads.

    Args:
      target: the GPU's figures.

    Returns:
      The text proto, for ``jax.experimental.topologies.get_topology_desc(target_config=...)``.
    """
    major, minor = target.compute_capability
    cudnn_major, cudnn_minor, cudnn_patch = target.cudnn_version
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {target.shared_memory_per_sm_bytes}
  threads_per_core_limit: 2048
  core_count: {target.sm_count}
  fpus_per_core: {target.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {target.memory_bandwidth_bytes_per_s}
  l2_cache_size: {target.l2_cache_bytes}
  clock_rate_ghz: {target.clock_rate_ghz}
  device_memory_size: {target.device_memory_bytes}
  shared_memory_per_block_optin: {target.shared_memory_per_block_optin_bytes}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: {target.registers_per_sm}
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
}}
platform_name: "CUDA"
dnn_version_info {{
  major: {cudnn_major}
  minor: {cudnn_minor}
  patch: {cudnn_patch}
}}
device_description_str: "{target.name}"
"""
