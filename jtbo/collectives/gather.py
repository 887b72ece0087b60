"""Gathering every DP rank's tokens onto every device (SGLang ``dp_gather_replicate``), in
shard_map.

Input: each device's local (TP_ATTN_FULL) buffer ``[local_capacity, ...]`` of its DP rank's
tokens, valid rows first, the same on every ``attn_tp`` device of the rank (the MoE input after
the post-attention norm, which needs the attention output already summed over ``attn_tp``).
Output: the gathered (FULL) buffer ``[global_buffer_len, ...]``, identical on every device,
laid out by the context's padding mode (``jtbo.collectives.context``). Rows past a rank's count
are zero in the output whatever the input held there.

MAX_LEN (all-gather of fixed slots). With ``attn_tp_size == 1``: an all-gather over the TP
group. With ``attn_tp_size > 1``: each device slices its ``1 / attn_tp`` block out of the local
buffer (the replicas are complete, so no reduction is needed), then the blocks are
all-gathered over the whole TP group, which lays them out DP-rank by DP-rank.

SUM_LEN (all-reduce of a packed buffer): a zero buffer, this rank's rows copied in at its
prefix-sum offset with ``jtbo.kernels.dp_memcpy`` by ``attn_tp`` rank 0 only (so the replicas
are counted once), then an all-reduce over the TP group. The all-reduce sums the rows' bits as
integers (``rows.as_int_words``): each row has one contributor and zeros elsewhere, so the
result is bit-exact whatever the rows hold (ids bitcast into float rows included), as MAX_LEN's
is.
"""

import jax
import jax.numpy as jnp

from jtbo import kernels
from jtbo.collectives import context as context_lib
from jtbo.collectives import mesh as mesh_lib
from jtbo.collectives import rows


def dp_gather_replicate(
    local_tokens: jax.Array, context: context_lib.DpContext, *, memcpy_impl: str | None = None
) -> jax.Array:
    """Gathers local buffers that are replicated over ``attn_tp`` into the global buffer.

    Args:
      local_tokens: ``[local_capacity, ...]`` the same on every ``attn_tp`` device of a rank.
      context: the step's DP context.
      memcpy_impl: ``impl`` of ``jtbo.kernels.dp_memcpy`` for SUM_LEN.

    Returns:
      ``[global_buffer_len, ...]`` laid out by the padding mode.

    Raises:
      ValueError: ``local_tokens`` rows differ from ``local_capacity`` or the context does not
        match the mesh.
    """
    if local_tokens.shape[0] != context.local_capacity:
        raise ValueError(
            f"local_tokens has {local_tokens.shape[0]} rows, context.local_capacity="
            f"{context.local_capacity}"
        )
    local_start_pos, local_num_tokens = context_lib.get_dp_local_info(context)
    local_tokens = rows.zero_rows_from(local_tokens, local_num_tokens)
    if context.padding_mode.is_max_len():
        return _gather_slots(local_tokens, context)
    return _gather_via_all_reduce(
        local_tokens, context, local_start_pos, local_num_tokens, memcpy_impl
    )


def _gather_slots(local_tokens, context):
    """All-gather of fixed ``local_capacity`` slots: rank r's rows at ``r * local_capacity``."""
    block = local_tokens
    if context.attn_tp_size > 1:
        attn_tp_rank = jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS)
        block = rows.attn_tp_shard(local_tokens, context.attn_tp_size, attn_tp_rank)
    # TP order is dp-major, so the blocks land DP rank by DP rank, attn_tp block by block.
    return jax.lax.all_gather(block, mesh_lib.TP_AXES, axis=0, tiled=True)


def _gather_via_all_reduce(local_tokens, context, local_start_pos, local_num_tokens, memcpy_impl):
    """This rank's rows at ``local_start_pos`` of a zero SUM_LEN buffer, all-reduced as bits."""
    # Only attn_tp rank 0 contributes, so each row has one contributor: its bits, summed as
    # integers with zeros, arrive unchanged.
    is_first = jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS) == 0
    local_num_tokens = jnp.where(is_first, local_num_tokens, 0)
    words = rows.as_int_words(local_tokens)
    buffer = jnp.zeros((context.global_buffer_len,) + words.shape[1:], words.dtype)
    buffer = kernels.dp_memcpy(
        buffer, words, local_start_pos, local_num_tokens, offset_src=False, impl=memcpy_impl
    )
    summed = jax.lax.psum(buffer, mesh_lib.TP_AXES)
    return rows.from_int_words(summed, local_tokens.shape[1:], local_tokens.dtype)
