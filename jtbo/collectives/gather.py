"""Gathering every DP rank's tokens onto every device (SGLang ``dp_gather_*``), in shard_map.

Input: each device's local (TP_ATTN_FULL) buffer ``[local_capacity, ...]`` of its DP rank's
tokens, valid rows first. Output: the gathered (FULL) buffer ``[global_buffer_len, ...]``,
identical on every device, laid out by the context's padding mode (``jtbo.collectives.context``).
Rows past a rank's count are zero in the output whatever the input held there.

*partial* vs *replicate* is about what the ``attn_tp`` devices of one DP rank hold:

* partial: each holds a partial sum (e.g. the output of a row-parallel projection); the
  gather also sums them.
* replicate: each holds the same complete values; they are counted once.

MAX_LEN (all-gather of fixed slots). With ``attn_tp_size == 1``: an all-gather over the TP
group. With ``attn_tp_size > 1``: each device first reduces to its ``1 / attn_tp`` block of the
local buffer (a reduce-scatter inside ``attn_tp`` for partial; for replicate the block is
already complete, so it is sliced out, which moves the same result without a reduction), then
the blocks are all-gathered over the whole TP group, which lays them out DP-rank by DP-rank.

SUM_LEN (all-reduce of a packed buffer): a zero buffer, this rank's rows copied in at its
prefix-sum offset with ``jtbo.kernels.dp_memcpy`` (for replicate only ``attn_tp`` rank 0 copies),
then an all-reduce over the TP group. Replicate gathers reduce the rows' bits as integers
(``rows.as_int_words``): each row has one contributor and zeros elsewhere, so the result is
bit-exact whatever the rows hold (ids bitcast into float rows included), as MAX_LEN's is.

Variable-length gather (``dp_gather_varlen``): the SUM_LEN layout obtained by an all-gather of
fixed slots followed by a local compaction, instead of an all-reduce of a zero-filled buffer;
valid because every rank's count fits its slot (``count <= local_capacity``).
"""

import jax
import jax.numpy as jnp

from jtbo import kernels
from jtbo.collectives import context as context_lib
from jtbo.collectives import mesh as mesh_lib
from jtbo.collectives import rows


def dp_gather_partial(
    local_tokens: jax.Array, context: context_lib.DpContext, *, memcpy_impl: str | None = None
) -> jax.Array:
    """Gathers (and sums over ``attn_tp``) partial local buffers into the global buffer.

    Args:
      local_tokens: ``[local_capacity, ...]`` this device's partial values.
      context: the step's DP context.
      memcpy_impl: ``impl`` of ``jtbo.kernels.dp_memcpy`` for SUM_LEN.

    Returns:
      ``[global_buffer_len, ...]`` summed over ``attn_tp``, laid out by the padding mode.

    Raises:
      ValueError: ``local_tokens`` rows differ from ``local_capacity`` or the context does not
        match the mesh.
    """
    return _dp_gather(local_tokens, context, is_partial=True, memcpy_impl=memcpy_impl)


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
      ValueError: as ``dp_gather_partial``.
    """
    return _dp_gather(local_tokens, context, is_partial=False, memcpy_impl=memcpy_impl)


def dp_gather_varlen(
    local_tokens: jax.Array, context: context_lib.DpContext, *, is_partial: bool
) -> jax.Array:
    """Gathers into the packed SUM_LEN layout through an all-gather of fixed slots.

    Args:
      local_tokens: ``[local_capacity, ...]`` this device's values.
      context: the step's DP context; its padding mode must be SUM_LEN (the output layout).
      is_partial: whether the ``attn_tp`` devices hold partial sums (else replicas).

    Returns:
      ``[global_buffer_len, ...]``: rank ``r``'s rows at its prefix-sum offset, zero after the
      token sum.

    Raises:
      ValueError: the context is not SUM_LEN, or as ``dp_gather_partial``.
    """
    if not context.padding_mode.is_sum_len():
        raise ValueError(
            f"dp_gather_varlen produces the SUM_LEN layout; context.padding_mode="
            f"{context.padding_mode.name}"
        )
    slots = _gather_slots(_masked_local(local_tokens, context), context, is_partial)
    return _pack_slots(slots, context)


def _dp_gather(local_tokens, context, *, is_partial, memcpy_impl):
    local_tokens = _masked_local(local_tokens, context)
    if context.padding_mode.is_max_len():
        return _gather_slots(local_tokens, context, is_partial)
    return _gather_via_all_reduce(local_tokens, context, is_partial, memcpy_impl)


def _masked_local(local_tokens, context):
    if local_tokens.shape[0] != context.local_capacity:
        raise ValueError(
            f"local_tokens has {local_tokens.shape[0]} rows, context.local_capacity="
            f"{context.local_capacity}"
        )
    _, local_num_tokens = context_lib.get_dp_local_info(context)
    return rows.zero_rows_from(local_tokens, local_num_tokens)


def _gather_slots(local_tokens, context, is_partial):
    """All-gather of fixed ``local_capacity`` slots: rank r's rows at ``r * local_capacity``."""
    if context.attn_tp_size == 1:
        return jax.lax.all_gather(local_tokens, mesh_lib.TP_AXES, axis=0, tiled=True)
    if is_partial:
        # Sums the attn_tp partials and leaves this device one block of the summed rows.
        block = jax.lax.psum_scatter(
            local_tokens, mesh_lib.ATTN_TP_AXIS, scatter_dimension=0, tiled=True
        )
    else:
        attn_tp_rank = jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS)
        block = rows.attn_tp_shard(local_tokens, context.attn_tp_size, attn_tp_rank)
    # TP order is dp-major, so the blocks land DP rank by DP rank, attn_tp block by block.
    return jax.lax.all_gather(block, mesh_lib.TP_AXES, axis=0, tiled=True)


def _gather_via_all_reduce(local_tokens, context, is_partial, memcpy_impl):
    local_start_pos, local_num_tokens = context_lib.get_dp_local_info(context)
    if is_partial:
        return _packed_all_reduce(
            local_tokens, context, local_start_pos, local_num_tokens, memcpy_impl
        )
    # Replicas: only attn_tp rank 0 contributes, so the all-reduce counts them once, and each
    # row then has one contributor: its bits, summed as integers with zeros, arrive unchanged.
    is_first = jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS) == 0
    local_num_tokens = jnp.where(is_first, local_num_tokens, 0)
    words = _packed_all_reduce(
        rows.as_int_words(local_tokens), context, local_start_pos, local_num_tokens, memcpy_impl
    )
    return rows.from_int_words(words, local_tokens.shape[1:], local_tokens.dtype)


def _packed_all_reduce(local_tokens, context, local_start_pos, local_num_tokens, memcpy_impl):
    """This rank's rows at ``local_start_pos`` of a zero SUM_LEN buffer, all-reduced."""
    buffer = jnp.zeros((context.global_buffer_len,) + local_tokens.shape[1:], local_tokens.dtype)
    buffer = kernels.dp_memcpy(
        buffer,
        local_tokens,
        local_start_pos,
        local_num_tokens,
        offset_src=False,
        impl=memcpy_impl,
    )
    return jax.lax.psum(buffer, mesh_lib.TP_AXES)


def _pack_slots(slots, context):
    """Moves rank r's first ``count[r]`` slot rows to its prefix-sum offset; zero after."""
    counts = context.global_num_tokens.astype(jnp.int32)
    inclusive = jnp.cumsum(counts)
    starts = inclusive - counts
    out_rows = jnp.arange(context.global_buffer_len, dtype=jnp.int32)
    # Owner of each output row: the first rank whose inclusive sum passes it (dp = none).
    owner = jnp.searchsorted(inclusive, out_rows, side="right").astype(jnp.int32)
    has_owner = owner < context.dp_size
    owner = jnp.minimum(owner, context.dp_size - 1)
    source = owner * context.local_capacity + out_rows - starts[owner]
    packed = jnp.take(slots, jnp.where(has_owner, source, 0), axis=0)
    return rows.zero_rows_from(packed, inclusive[-1])
