"""Small row helpers shared by the DP collectives (inside ``jax.shard_map``)."""

import jax
import jax.numpy as jnp


def zero_rows_from(x: jax.Array, num_valid: jax.Array) -> jax.Array:
    """Returns ``x`` with rows ``num_valid`` and later set to zero.

    Args:
      x: rows along axis 0, any trailing shape.
      num_valid: traced count of leading rows to keep.

    Returns:
      The masked array, same shape and dtype.
    """
    keep = jnp.arange(x.shape[0], dtype=jnp.int32) < num_valid
    keep = keep.reshape((x.shape[0],) + (1,) * (x.ndim - 1))
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


def attn_tp_shard(x: jax.Array, attn_tp_size: int, attn_tp_rank: jax.Array) -> jax.Array:
    """This attention-TP rank's contiguous ``1 / attn_tp_size`` block of rows of ``x``.

    Args:
      x: rows along axis 0; their number must be a multiple of ``attn_tp_size``.
      attn_tp_size: devices per DP rank.
      attn_tp_rank: this device's traced index on the ``attn_tp`` axis.

    Returns:
      Rows ``[rank * n, (rank + 1) * n)`` with ``n = rows / attn_tp_size``.

    Raises:
      ValueError: the rows do not split evenly.
    """
    if x.shape[0] % attn_tp_size:
        raise ValueError(f"rows={x.shape[0]} do not split over attn_tp_size={attn_tp_size}")
    shard_rows = x.shape[0] // attn_tp_size
    return jax.lax.dynamic_slice_in_dim(x, attn_tp_rank * shard_rows, shard_rows, axis=0)
