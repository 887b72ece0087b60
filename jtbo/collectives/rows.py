"""Small row helpers shared by the DP and EP collectives and the expert layouts."""

import math

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


RANK_BLOCK = 128
"""Elements per block of ``group_ranks``' blocked running count."""


def group_ranks(
    group: jax.Array, num_groups: int, *, block: int = RANK_BLOCK
) -> tuple[jax.Array, jax.Array]:
    """Each element's rank within its group (an exclusive running count) and each group's size.

    The rank is the slot of a (token, choice) pair in its expert's (or its peer's) buffer: EP
    dispatch ranks pairs within their peer and expert (``rank_within_group``), the
    capacity-slot expert layout within their expert (this); the sizes are the experts' row
    counts.

    Blocked, so that nothing of ``N * num_groups`` elements is ever written: the elements are
    cut into blocks of ``block``; a histogram per block (``[N / block, num_groups]``) and its
    exclusive running sum over the blocks give each group's count before a block, and within a
    block an element counts the earlier elements of its own group (``block`` compares each).
    All three are reductions that XLA fuses with their compares, where a one-hot running sum
    over all elements (``rank_within_group``) writes and reads ``N * num_groups`` counts, and a
    ``bincount`` serializes its atomic adds on a few addresses.

    Args:
      group: ``[N]`` integer group of each element; a value outside ``[0, num_groups)`` (e.g.
        ``num_groups`` or -1 for "no group") counts for no group.
      num_groups: number of groups.
      block: elements per block (clipped to ``[1, N]``).

    Returns:
      ``([N] int32 ranks, 0 for elements outside every group; [num_groups] int32 sizes)``.
    """
    size = group.shape[0]
    if size == 0:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((num_groups,), jnp.int32)
    label = _block_labels(group, num_groups, max(1, min(block, size)))  # [B, S]
    hist = _block_histogram(label, num_groups)  # [B, G]
    before = jnp.cumsum(hist, axis=0, dtype=jnp.int32) - hist  # [B, G] counts in earlier blocks
    position = jnp.arange(label.shape[1], dtype=jnp.int32)
    earlier = position[None, :] < position[:, None]  # [i, j]: j comes before i
    same = label[:, :, None] == label[:, None, :]  # [B, S, S]
    within = jnp.sum(same & earlier[None], axis=2, dtype=jnp.int32)  # [B, S]
    base = jnp.take_along_axis(before, jnp.minimum(label, num_groups - 1), axis=1)
    rank = jnp.where(label < num_groups, base + within, 0).reshape(-1)[:size]
    return rank, before[-1] + hist[-1]


def rank_within_group(group: jax.Array, num_groups: int) -> jax.Array:
    """For each element, how many earlier elements share its group, as a one-hot running count
    over ``[N, num_groups]``.

    The EP exchanges rank their pairs with it, within a peer or a device's local experts: few
    groups, few pairs, and their compiled schedules (what runs beside each all-to-all) are
    built around these fusions. ``group_ranks`` gives the same ranks without the one-hot
    array, for many groups over many elements (the capacity-slot layout's experts).

    Args:
      group: ``[N]`` integer group of each element; a value outside ``[0, num_groups)`` (e.g.
        ``num_groups`` or -1 for "no group") counts for no group.
      num_groups: number of groups.

    Returns:
      ``[N]`` int32 ranks; 0 for elements outside every group.
    """
    one_hot = group[:, None] == jnp.arange(num_groups, dtype=group.dtype)[None, :]
    earlier = jnp.cumsum(one_hot, axis=0, dtype=jnp.int32) - one_hot
    return jnp.sum(jnp.where(one_hot, earlier, 0), axis=1)


def _block_labels(group: jax.Array, num_groups: int, block: int) -> jax.Array:
    """``[ceil(N / block), block]`` int32 groups, ``num_groups`` for no group and padding."""
    in_group = (group >= 0) & (group < num_groups)
    label = jnp.where(in_group, group, num_groups).astype(jnp.int32)
    padding = -label.shape[0] % block
    label = jnp.pad(label, (0, padding), constant_values=num_groups)
    return label.reshape(-1, block)


def _block_histogram(label: jax.Array, num_groups: int) -> jax.Array:
    """``[B, num_groups]`` int32 elements of each group per block of ``label [B, S]``."""
    # Reduced over the minor axis: a row reduction per (block, group), compares fused in.
    groups = jnp.arange(num_groups, dtype=jnp.int32)
    return jnp.sum(label[:, None, :] == groups[None, :, None], axis=2, dtype=jnp.int32)


def pack_int32_columns(rows: jax.Array, values: jax.Array) -> jax.Array:
    """``rows`` with int32 ``values`` bitcast into trailing columns: one collective moves both.

    Every collective takes a slot of XLA:GPU's async-collective overlap limit and a window of
    its own: measured on a 4 x 2 H200 compile of the model's decode step, a separate id
    all-to-all left the row exchanges beside it uncovered. Small side arrays (expert ids,
    routing weights bitcast to int32) riding in the rows' buffer need neither. A bitcast moves
    the bits unchanged.

    Args:
      rows: ``[N, H]`` rows of any dtype.
      values: ``[N, k]`` int32 (bitcast float32 to int32 first).

    Returns:
      ``[N, H + k * c]`` in ``rows.dtype``: ``c = 4 // itemsize`` columns per value for rows
      of at most 4 bytes, one column (the value widened to the row's width) for wider rows.

    Raises:
      ValueError: values that are not int32.
    """
    if values.dtype != jnp.int32:
        raise ValueError(
            f"pack_int32_columns packs int32 values (bitcast float32 first) into rows of any "
            f"dtype, c = 4 // itemsize columns each for rows of at most 4 bytes; got values of "
            f"{values.dtype}"
        )
    itemsize = jnp.dtype(rows.dtype).itemsize
    if itemsize > 4:
        values = values.astype(jnp.dtype(f"int{8 * itemsize}"))
    columns = jax.lax.bitcast_convert_type(values, rows.dtype)
    return jnp.concatenate([rows, columns.reshape(rows.shape[0], -1)], axis=1)


def unpack_int32_columns(payload: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``pack_int32_columns``: ``([N, width] rows, [N, k] int32 values)``."""
    itemsize = jnp.dtype(payload.dtype).itemsize
    columns = payload[:, width:]
    if itemsize < 4:
        columns = columns.reshape(payload.shape[0], -1, 4 // itemsize)
    value_dtype = jnp.int32 if itemsize <= 4 else jnp.dtype(f"int{8 * itemsize}")
    values = jax.lax.bitcast_convert_type(columns, value_dtype)
    return payload[:, :width], values.astype(jnp.int32)


def as_int_words(x: jax.Array) -> jax.Array:
    """The bits of ``[N, ...]`` rows as ``[N, words]`` integers of at least 32 bits.

    An integer sum of one row's words and zeros gives the row's words back, whatever they
    encode; a float sum would not (it flushes denormals, such as small ids bitcast into the
    rows by ``pack_int32_columns``, and turns -0.0 into 0.0). Rows of narrow dtypes are padded
    with zero bytes to whole int32 words.

    Args:
      x: rows along axis 0, any trailing shape and dtype.

    Returns:
      ``[N, words]`` int32 (int64 for 8-byte dtypes).
    """
    flat = x.reshape(x.shape[0], -1)
    itemsize = jnp.dtype(x.dtype).itemsize
    if itemsize >= 4:
        return jax.lax.bitcast_convert_type(flat, jnp.dtype(f"int{8 * itemsize}"))
    per_word = 4 // itemsize
    pad = -flat.shape[1] % per_word
    flat = jnp.pad(flat, ((0, 0), (0, pad)))
    grouped = flat.reshape(flat.shape[0], -1, per_word)
    return jax.lax.bitcast_convert_type(grouped, jnp.int32)


def from_int_words(words: jax.Array, row_shape: tuple[int, ...], dtype) -> jax.Array:
    """Inverse of ``as_int_words``: ``[N, *row_shape]`` rows of ``dtype`` from their words.

    Args:
      words: ``[N, words]`` from ``as_int_words`` (any number of rows).
      row_shape: the trailing shape of the original rows.
      dtype: the original dtype.

    Returns:
      ``[N, *row_shape]`` of ``dtype``, bit for bit the rows that made the words.
    """
    values = jax.lax.bitcast_convert_type(words, dtype).reshape(words.shape[0], -1)
    size = math.prod(row_shape)
    return values[:, :size].reshape((words.shape[0], *row_shape))
