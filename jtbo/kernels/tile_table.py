"""The row tiles of a grouped GEMM: which rows of which group each tile covers.

A grouped GEMM over groups (experts) of rows cuts each group into ``block_m``-row tiles; a
group's last tile may be partly past its rows. The kernels walk a table of tiles, live tiles
first, padded to a static length with dead tiles (group -1), so the grid is static while the
counts are traced.

``row_tiles`` builds the table with a few small XLA ops (a running sum, a search, gathers), each
a kernel launch on a GPU. ``row_tiles_pallas`` builds the table of groups laid out at a fixed
stride (the capacity slots: group ``e`` from row ``e * stride``) in one Pallas kernel, its
sizes clipped to ``[0, max_group_size]`` on the way: one program per ``block_tiles`` table
entries, each summing the groups' tile counts itself (a running sum over E), finding each
entry's group as the number of groups that end at or before it, and reading that group's
first tile and size through a one-hot over the groups (a register vector takes no traced
index). Its reference is ``row_tiles`` over the clipped sizes.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.core import arith

_ONE_HOT_ELEMS = 16384  # a program's [block_tiles, groups] one-hot, in registers


def max_tiles(num_groups: int, group_rows: int, block_m: int, max_rows: int | None) -> int:
    """Tiles the table needs: every possible tile, or fewer under a bound on the total rows.

    Args:
      num_groups: groups (experts).
      group_rows: rows each group can hold (the capacity).
      block_m: rows per tile.
      max_rows: static bound on the groups' total rows, or None.

    Returns:
      The table length.
    """
    every = num_groups * arith.ceil_div(group_rows, block_m)
    if max_rows is None:
        return every
    # sum_e ceil(n_e / b) <= (sum_e n_e + E * (b - 1)) / b
    return max(1, min(every, (max_rows + num_groups * (block_m - 1)) // block_m))


def tile_spans(group_size: jax.Array, block_m: int) -> tuple[jax.Array, jax.Array]:
    """Where each group's tiles sit in the table of live tiles.

    Args:
      group_size: ``[E]`` int32 rows of each group (>= 0).
      block_m: rows per tile.

    Returns:
      ``([E] first tile of each group, [E] one past its last tile)``, int32.
    """
    blocks = arith.ceil_div(group_size, block_m).astype(jnp.int32)
    ends = jnp.cumsum(blocks, dtype=jnp.int32)
    return ends - blocks, ends


def _row_tiles_kernel(
    size_ref, table_ref, *, num_groups, groups_pad, group_stride, block_m, num_tiles,
    block_tiles, max_group_size,
):  # fmt: skip
    # size_ref: [E] int32; table_ref: [3, num_tiles] int32. Group lanes past E load through
    # an index one past the end, masked (the interpreter fills them).
    groups = jnp.arange(groups_pad, dtype=jnp.int32)
    real = groups < num_groups
    size = plgpu.load(size_ref.at[jnp.where(real, groups, num_groups)], mask=real, other=0)
    size = jnp.clip(size, 0, max_group_size)
    group_start = groups * group_stride
    blocks = arith.ceil_div(size, block_m)
    ends = jnp.cumsum(blocks, axis=0)
    first_entry = pl.program_id(0) * block_tiles
    index = first_entry + jnp.arange(block_tiles, dtype=jnp.int32)
    ended = (ends[None, :] <= index[:, None]) & real[None, :]
    group = jnp.minimum(jnp.sum(ended.astype(jnp.int32), axis=1), num_groups - 1)
    pick = group[:, None] == groups[None, :]

    def of_group(values):
        return jnp.sum(jnp.where(pick, values[None, :], 0), axis=1)

    live = index < jnp.sum(blocks)
    start = of_group(group_start) + (index - of_group(ends - blocks)) * block_m
    end = of_group(group_start + size)
    entries = pl.ds(first_entry, block_tiles)
    inside = index < num_tiles
    rows = (jnp.where(live, group, -1), jnp.where(live, start, 0), jnp.where(live, end, 0))
    for row, values in enumerate(rows):
        plgpu.store(table_ref.at[pl.ds(row, 1), entries], values[None, :], mask=inside[None, :])


def row_tiles_pallas(
    group_size: jax.Array,
    group_stride: int,
    block_m: int,
    num_tiles: int,
    max_group_size: int,
    interpret: bool,
) -> jax.Array:
    """``row_tiles`` of groups at a fixed stride, in one Pallas kernel.

    Args:
      group_size: ``[E]`` int32 rows of each group, clipped to ``[0, max_group_size]``.
      group_stride: group ``e``'s first row is ``e * group_stride``.
      block_m, num_tiles: as ``row_tiles``.
      max_group_size: the clip's upper end (e.g. the capacity).
      interpret: run the Pallas interpreter (the CPU) instead of the Triton lowering.

    Returns:
      ``row_tiles(arange(E) * group_stride, clip(group_size, 0, max_group_size), ...)``.
    """
    num_groups = group_size.shape[0]
    groups_pad = arith.power_of_two_at_least(num_groups)
    block_tiles = max(16, min(128, _ONE_HOT_ELEMS // groups_pad))
    block_tiles = min(block_tiles, arith.power_of_two_at_least(num_tiles, 16))
    kernel = functools.partial(
        _row_tiles_kernel, num_groups=num_groups, groups_pad=groups_pad,
        group_stride=group_stride, block_m=block_m, num_tiles=num_tiles,
        block_tiles=block_tiles, max_group_size=max_group_size,
    )  # fmt: skip
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((3, num_tiles), jnp.int32),
        grid=(arith.ceil_div(num_tiles, block_tiles),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(group_size.astype(jnp.int32))


def row_tiles(
    group_start: jax.Array, group_size: jax.Array, block_m: int, num_tiles: int
) -> jax.Array:
    """The tile table: ``block_m``-row tiles of every group, live tiles first.

    Args:
      group_start: ``[E]`` int32 first row of each group in the flat row array.
      group_size: ``[E]`` int32 rows of each group (>= 0).
      block_m: rows per tile.
      num_tiles: table length (static); tiles past it are not listed.

    Returns:
      ``[3, num_tiles]`` int32: expert (-1 past the live tiles), first row, end row (the
      group's end, so the last tile of a group masks its rows past it).
    """
    first, ends = tile_spans(group_size, block_m)
    index = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.searchsorted(ends, index, side="right", method="compare_all")
    group = jnp.minimum(group, group_size.shape[0] - 1).astype(jnp.int32)
    live = index < ends[-1]
    start = group_start[group] + (index - first[group]) * block_m
    end = group_start[group] + group_size[group]
    table = [jnp.where(live, group, -1), jnp.where(live, start, 0), jnp.where(live, end, 0)]
    return jnp.stack(table).astype(jnp.int32)
