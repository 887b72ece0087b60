"""Taking this DP rank's tokens back out of the gathered buffer, in shard_map.

* ``dp_scatter`` (SGLang's): the gathered buffer holds complete values on every device; copy
  this rank's ``count`` rows from its offset into a zeroed local buffer with
  ``jtbo.kernels.dp_memcpy``.
* ``dp_reduce_scatter_tensor``: the gathered buffer holds partial sums (e.g. a row-parallel
  MLP's output before its all-reduce); sum them and keep this rank's rows. MAX_LEN's fixed
  slots split evenly, so it is one reduce-scatter over the TP group (each device gets a
  ``1 / (dp * attn_tp)`` block) followed, when ``attn_tp_size > 1``, by an all-gather inside
  ``attn_tp`` that reassembles the rank's slot. SUM_LEN's packed ranks do not split evenly:
  it is an all-reduce followed by ``dp_scatter``.

Rows past the rank's count are zero in the local output.
"""

import jax
import jax.numpy as jnp

from jtbo import kernels
from jtbo.collectives import context as context_lib
from jtbo.collectives import mesh as mesh_lib
from jtbo.collectives import rows


def dp_scatter(
    global_tokens: jax.Array, context: context_lib.DpContext, *, memcpy_impl: str | None = None
) -> jax.Array:
    """Copies this DP rank's rows out of the gathered buffer.

    Args:
      global_tokens: ``[global_buffer_len, ...]`` complete values, same on every device.
      context: the step's DP context.
      memcpy_impl: ``impl`` of ``jtbo.kernels.dp_memcpy``.

    Returns:
      ``[local_capacity, ...]`` this rank's tokens, zero past its count.

    Raises:
      ValueError: ``global_tokens`` rows differ from ``global_buffer_len`` or the context does
        not match the mesh.
    """
    _check_global_rows(global_tokens, context)
    local_start_pos, local_num_tokens = context_lib.get_dp_local_info(context)
    local = jnp.zeros((context.local_capacity,) + global_tokens.shape[1:], global_tokens.dtype)
    return kernels.dp_memcpy(
        local,
        global_tokens,
        local_start_pos,
        local_num_tokens,
        offset_src=True,
        impl=memcpy_impl,
    )


def dp_reduce_scatter_tensor(
    global_tokens: jax.Array, context: context_lib.DpContext, *, memcpy_impl: str | None = None
) -> jax.Array:
    """Sums partial gathered buffers over the TP group and keeps this DP rank's rows.

    Args:
      global_tokens: ``[global_buffer_len, ...]`` this device's partial sums.
      context: the step's DP context.
      memcpy_impl: ``impl`` of ``jtbo.kernels.dp_memcpy`` (SUM_LEN only).

    Returns:
      ``[local_capacity, ...]`` this rank's summed tokens, zero past its count.

    Raises:
      ValueError: as ``dp_scatter``.
    """
    _check_global_rows(global_tokens, context)
    if context.padding_mode.is_sum_len():
        summed = jax.lax.psum(global_tokens, mesh_lib.TP_AXES)
        return dp_scatter(summed, context, memcpy_impl=memcpy_impl)
    block = jax.lax.psum_scatter(global_tokens, mesh_lib.TP_AXES, scatter_dimension=0, tiled=True)
    if context.attn_tp_size > 1:
        block = jax.lax.all_gather(block, mesh_lib.ATTN_TP_AXIS, axis=0, tiled=True)
    _, local_num_tokens = context_lib.get_dp_local_info(context)
    return rows.zero_rows_from(block, local_num_tokens)


def _check_global_rows(global_tokens, context):
    if global_tokens.shape[0] != context.global_buffer_len:
        raise ValueError(
            f"global_tokens has {global_tokens.shape[0]} rows, context.global_buffer_len="
            f"{context.global_buffer_len}"
        )
