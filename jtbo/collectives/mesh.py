"""The ("dp", "attn_tp") device mesh of DP attention, and SGLang's rank layout.

With DP attention, the ``tp_size`` devices of one model replica are split into ``dp_size``
attention-DP groups of ``attn_tp_size`` devices each. A DP rank attends over its own requests;
inside a DP rank, attention heads are tensor-parallel over ``attn_tp``. Rank numbering follows
SGLang: attention TP is the fastest-changing index, so
``tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank`` (jtbo has no attention context
parallelism, which SGLang puts between the two). The JAX mesh puts ``dp`` first and
``attn_tp`` second, so a device's linear position in the mesh is its SGLang ``tp_rank``;
collectives over the tuple ``(DP_AXIS, ATTN_TP_AXIS)`` (the whole TP group, also the
expert-parallel group) enumerate devices in that order.
"""

import jax
import numpy as np

DP_AXIS = "dp"
ATTN_TP_AXIS = "attn_tp"
# The whole TP group: every device of the replica, in SGLang tp_rank order.
TP_AXES = (DP_AXIS, ATTN_TP_AXIS)


class TooFewDevicesError(ValueError):
    """The host has fewer devices than a mesh needs.

    Attributes:
      needed: the mesh's devices.
      available: the host's devices.
    """

    def __init__(self, message: str, needed: int, available: int):
        super().__init__(message)
        self.needed, self.available = needed, available


def make_mesh(dp_size: int, attn_tp_size: int, devices=None) -> jax.sharding.Mesh:
    """Returns a ``(dp_size, attn_tp_size)`` mesh with axes ``("dp", "attn_tp")``.

    The axes are ``Auto`` (not jax's default Explicit), so ``jax.shard_map`` bodies see plain
    local shards.

    Args:
      dp_size: number of attention-DP ranks.
      attn_tp_size: devices per DP rank (attention tensor parallelism).
      devices: the devices, in SGLang ``tp_rank`` order; the first ``dp_size * attn_tp_size``
        of ``jax.devices()`` when None.

    Returns:
      The mesh.

    Raises:
      TooFewDevicesError: ``devices`` is None and the host has too few.
      ValueError: a size is below 1, or ``devices`` holds another number of devices.
    """
    if dp_size < 1 or attn_tp_size < 1:
        raise ValueError(f"dp_size={dp_size} and attn_tp_size={attn_tp_size} must be >= 1")
    num_devices = dp_size * attn_tp_size
    if devices is None:
        available = jax.devices()
        if len(available) < num_devices:
            raise TooFewDevicesError(
                f"dp_size={dp_size} x attn_tp_size={attn_tp_size} needs {num_devices} devices, "
                f"only {len(available)} available",
                num_devices,
                len(available),
            )
        devices = available[:num_devices]
    devices = list(np.asarray(devices).flat)
    if len(devices) != num_devices:
        raise ValueError(
            f"dp_size={dp_size} x attn_tp_size={attn_tp_size} needs {num_devices} devices, "
            f"got {len(devices)}"
        )
    return jax.sharding.Mesh(
        np.asarray(devices, dtype=object).reshape(dp_size, attn_tp_size),
        TP_AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )


def mesh_platform(mesh: jax.sharding.Mesh) -> str:
    """The platform the mesh's devices compile for ("cpu", "gpu", "tpu")."""
    return mesh.devices.flat[0].platform
