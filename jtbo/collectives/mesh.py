"""The ("dp", "attn_tp") device mesh of DP attention, and SGLang's rank layout.

With DP attention, the ``tp_size`` devices of one model replica are split into ``dp_size``
attention-DP groups of ``attn_tp_size`` devices each. A DP rank attends over its own requests;
inside a DP rank, attention heads are tensor-parallel over ``attn_tp``. Rank numbering follows
SGLang: attention TP is the fastest-changing index, so
``tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank`` (with context parallelism between
them when ``attn_cp_size > 1``). The JAX mesh puts ``dp`` first and ``attn_tp`` second, so a
device's linear position in the mesh is its SGLang ``tp_rank``; collectives over the tuple
``(DP_AXIS, ATTN_TP_AXIS)`` (the whole TP group, also the expert-parallel group) enumerate
devices in that order.
"""

import jax
import numpy as np

DP_AXIS = "dp"
ATTN_TP_AXIS = "attn_tp"
# The whole TP group: every device of the replica, in SGLang tp_rank order.
TP_AXES = (DP_AXIS, ATTN_TP_AXIS)


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
      ValueError: a size is below 1 or there are not exactly enough devices.
    """
    if dp_size < 1 or attn_tp_size < 1:
        raise ValueError(f"dp_size={dp_size} and attn_tp_size={attn_tp_size} must be >= 1")
    num_devices = dp_size * attn_tp_size
    if devices is None:
        available = jax.devices()
        if len(available) < num_devices:
            raise ValueError(
                f"dp_size={dp_size} x attn_tp_size={attn_tp_size} needs {num_devices} devices, "
                f"only {len(available)} available"
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


def compute_dp_attention_world_info(
    enable_dp_attention: bool, tp_rank: int, tp_size: int, dp_size: int, attn_cp_size: int = 1
) -> tuple[int, int, int, int]:
    """A device's place in the DP-attention layout (SGLang's rank arithmetic).

    Args:
      enable_dp_attention: whether attention is data-parallel; without it there is a single
        attention DP rank spanning all ``tp_size`` devices.
      tp_rank: the device's rank in the TP group.
      tp_size: devices in the TP group.
      dp_size: attention-DP ranks when DP attention is on.
      attn_cp_size: attention context-parallel ranks per DP rank.

    Returns:
      ``(attn_tp_rank, attn_tp_size, attn_dp_rank, attn_dp_size)``.

    Raises:
      ValueError: the sizes do not divide ``tp_size`` or ``tp_rank`` is out of range.
    """
    attn_dp_size = dp_size if enable_dp_attention else 1
    if attn_dp_size < 1 or attn_cp_size < 1 or tp_size % (attn_dp_size * attn_cp_size):
        raise ValueError(
            f"tp_size={tp_size} must be a positive multiple of attn_dp_size={attn_dp_size} "
            f"x attn_cp_size={attn_cp_size}"
        )
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is outside [0, tp_size={tp_size})")
    attn_tp_size = tp_size // attn_dp_size // attn_cp_size
    attn_tp_rank = tp_rank % attn_tp_size
    # Ranks are laid out (dp, cp, tp) with tp fastest, so the DP rank skips whole cp*tp blocks.
    attn_dp_rank = tp_rank // (attn_tp_size * attn_cp_size) if enable_dp_attention else 0
    return attn_tp_rank, attn_tp_size, attn_dp_rank, attn_dp_size


def mesh_platform(mesh: jax.sharding.Mesh) -> str:
    """The platform the mesh's devices compile for ("cpu", "gpu", "tpu")."""
    return mesh.devices.flat[0].platform
