"""What the in-graph DP collectives need to know about one step: ``DpContext``.

Shapes inside a jitted step are static, counts are not. A ``DpContext`` carries the per-rank
token counts as a traced ``[dp]`` int32 array (the same on every device: pass it replicated,
``P()``, into ``jax.shard_map``) and, as static fields, the padding mode and the two buffer
lengths that fix the shapes:

* ``local_capacity``: rows of a DP rank's local (TP_ATTN_FULL) buffer; every rank's count is
  at most this. A multiple of ``attn_tp_size`` so the buffer splits evenly into SCATTERED
  shards.
* ``global_buffer_len``: rows of the gathered (FULL) buffer. MAX_LEN: ``dp * local_capacity``
  with rank ``r`` at row ``r * local_capacity``. SUM_LEN: at least ``sum(counts)``, ranks packed
  at their prefix-sum offsets, rows past the sum zero; by default the sum's bucket
  (``sum_len_bucket``: about four lengths per power of two), capped at the MAX_LEN length.

A jitted step compiles once per distinct static part (one per bucket, mode and, for SUM_LEN,
buffer-length bucket), never per count.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.collectives import mesh as mesh_lib
from jtbo.collectives import padding
from jtbo.core import arith


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DpContext:
    """Per-step DP-attention facts for the in-graph collectives.

    Attributes:
      global_num_tokens: valid tokens of each DP rank (replicated on every device).
      padding_mode: layout of the gathered buffer.
      local_capacity: rows of each DP rank's local buffer.
      global_buffer_len: rows of the gathered buffer.
      attn_tp_size: devices per DP rank (checked against the mesh when used).
    """

    global_num_tokens: np.ndarray | jax.Array  # [dp] int32: numpy on the host, traced in jit
    padding_mode: padding.DpPaddingMode = dataclasses.field(metadata=dict(static=True))
    local_capacity: int = dataclasses.field(metadata=dict(static=True))
    global_buffer_len: int = dataclasses.field(metadata=dict(static=True))
    attn_tp_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def dp_size(self) -> int:
        """Number of DP ranks (the length of ``global_num_tokens``)."""
        return self.global_num_tokens.shape[0]


def create_dp_context(
    global_num_tokens: Sequence[int] | np.ndarray,
    padding_mode: padding.DpPaddingMode,
    local_capacity: int,
    attn_tp_size: int = 1,
    global_buffer_len: int | None = None,
) -> DpContext:
    """Builds and checks a ``DpContext`` on the host.

    Args:
      global_num_tokens: valid tokens of each DP rank.
      padding_mode: layout of the gathered buffer.
      local_capacity: rows of each rank's local buffer (a multiple of ``attn_tp_size``).
      attn_tp_size: devices per DP rank.
      global_buffer_len: rows of the gathered buffer; None picks
        ``default_global_buffer_len`` (``dp * local_capacity`` for MAX_LEN, the bucketed token
        sum for SUM_LEN).

    Returns:
      The context, with ``global_num_tokens`` as an int32 numpy array (a host value: a step
      packs it with its other plan arrays for one host->device transfer, see
      ``jtbo.split.packing``).

    Raises:
      ValueError: a count exceeds ``local_capacity``, the capacity does not split over
        ``attn_tp_size``, or ``global_buffer_len`` cannot hold the layout.
    """
    counts = np.asarray(global_num_tokens, dtype=np.int64).reshape(-1)
    dp_size = counts.shape[0]
    if attn_tp_size < 1 or local_capacity < 1 or local_capacity % attn_tp_size:
        raise ValueError(
            f"local_capacity={local_capacity} must be a positive multiple of "
            f"attn_tp_size={attn_tp_size}"
        )
    if dp_size == 0 or counts.min() < 0 or counts.max() > local_capacity:
        raise ValueError(
            f"global_num_tokens={counts.tolist()} must be non-empty, in [0, "
            f"local_capacity={local_capacity}]"
        )
    padding_mode = padding.DpPaddingMode(padding_mode)
    if global_buffer_len is None:
        global_buffer_len = default_global_buffer_len(
            counts.tolist(), padding_mode, local_capacity, attn_tp_size
        )
    _check_global_buffer_len(counts, padding_mode, local_capacity, global_buffer_len)
    return DpContext(
        global_num_tokens=counts.astype(np.int32),
        padding_mode=padding_mode,
        local_capacity=int(local_capacity),
        global_buffer_len=int(global_buffer_len),
        attn_tp_size=int(attn_tp_size),
    )


SUM_LEN_BUCKETS_PER_OCTAVE = 4
"""SUM_LEN buffer lengths per power of two (a power of two itself): a sum in ``(2^k, 2^(k+1)]``
is rounded up to a multiple of ``2^k / 4``, so a buffer pads less than a quarter of its sum and
the sums of one doubling share four lengths (four compiles at most)."""


def sum_len_bucket(total: int, attn_tp_size: int = 1) -> int:
    """The bucketed SUM_LEN buffer length of a token sum (before the MAX_LEN cap).

    Args:
      total: the token sum of all DP ranks, >= 0.
      attn_tp_size: devices per DP rank; the length is a multiple of it.

    Returns:
      ``total`` (at least 1) rounded up to a multiple of ``2^k / SUM_LEN_BUCKETS_PER_OCTAVE``
      for ``total`` in ``(2^k, 2^(k+1)]`` (of 1 when that is below 1), then to
      ``attn_tp_size``.

    Raises:
      ValueError: a negative ``total`` or ``attn_tp_size < 1``.
    """
    if total < 0 or attn_tp_size < 1:
        raise ValueError(f"total={total} must be >= 0 and attn_tp_size={attn_tp_size} >= 1")
    total = max(int(total), 1)
    k = (total - 1).bit_length() - 1  # total in (2^k, 2^(k+1)]
    steps_log2 = SUM_LEN_BUCKETS_PER_OCTAVE.bit_length() - 1
    granule = 1 << max(0, k - steps_log2)
    return arith.round_up(arith.round_up(total, granule), attn_tp_size)


def default_global_buffer_len(
    global_num_tokens: Sequence[int],
    padding_mode: padding.DpPaddingMode,
    local_capacity: int,
    attn_tp_size: int = 1,
) -> int:
    """Rows of the gathered buffer: a bucket of the step's sizes, so that a jitted step
    compiles once per bucket, not once per token sum.

    Args:
      global_num_tokens: valid tokens of each DP rank.
      padding_mode: layout of the gathered buffer.
      local_capacity: rows of each rank's local buffer (a multiple of ``attn_tp_size``).
      attn_tp_size: devices per DP rank; SUM_LEN lengths are a multiple of it.

    Returns:
      ``dp * local_capacity`` for MAX_LEN; for SUM_LEN the token sum's ``sum_len_bucket``,
      at most ``dp * local_capacity`` (which always holds the sum).
    """
    max_len = len(global_num_tokens) * local_capacity
    if padding.DpPaddingMode(padding_mode).is_max_len():
        return max_len
    return min(sum_len_bucket(int(sum(global_num_tokens)), attn_tp_size), max_len)


def _check_global_buffer_len(counts, padding_mode, local_capacity, global_buffer_len):
    dp_size = counts.shape[0]
    if padding_mode.is_max_len() and global_buffer_len != dp_size * local_capacity:
        raise ValueError(
            f"MAX_LEN global_buffer_len={global_buffer_len} must equal dp_size={dp_size} x "
            f"local_capacity={local_capacity}"
        )
    if padding_mode.is_sum_len() and not counts.sum() <= global_buffer_len:
        raise ValueError(
            f"SUM_LEN global_buffer_len={global_buffer_len} is below the token sum "
            f"{int(counts.sum())} of global_num_tokens={counts.tolist()}"
        )


def check_context_matches_mesh(context: DpContext) -> None:
    """Checks, inside ``jax.shard_map``, that the context's sizes are the mesh's.

    Raises:
      ValueError: ``dp`` or ``attn_tp`` differ from the mesh axis sizes.
    """
    dp_size = jax.lax.axis_size(mesh_lib.DP_AXIS)
    attn_tp_size = jax.lax.axis_size(mesh_lib.ATTN_TP_AXIS)
    if (context.dp_size, context.attn_tp_size) != (dp_size, attn_tp_size):
        raise ValueError(
            f"DpContext has dp={context.dp_size}, attn_tp={context.attn_tp_size} but the mesh "
            f"has dp={dp_size}, attn_tp={attn_tp_size}"
        )


def get_dp_local_info(context: DpContext) -> tuple[jax.Array, jax.Array]:
    """This DP rank's first row in the gathered buffer and its token count (in shard_map).

    MAX_LEN places rank ``r`` at ``r * local_capacity``; SUM_LEN at the sum of the counts of
    ranks before it.

    Args:
      context: the step's DP context.

    Returns:
      ``(local_start_pos, local_num_tokens)``, traced int32 scalars.
    """
    check_context_matches_mesh(context)
    dp_rank = jax.lax.axis_index(mesh_lib.DP_AXIS)
    counts = jnp.asarray(context.global_num_tokens, jnp.int32)
    local_num_tokens = counts[dp_rank]
    if context.padding_mode.is_max_len():
        return (dp_rank * context.local_capacity).astype(jnp.int32), local_num_tokens
    # Exclusive prefix sum: the rows of all ranks before this one.
    exclusive = jnp.cumsum(counts) - counts
    return exclusive[dp_rank].astype(jnp.int32), local_num_tokens
