"""The row tiles of a grouped GEMM: which rows of which group each tile covers.

A grouped GEMM over groups (experts) of rows cuts each group into ``block_m``-row tiles; a
group's last tile may be partly past its rows. The kernels walk a table of tiles, live tiles
first, padded to a static length with dead tiles (group -1), so the grid is static while the
counts are traced. The Mosaic GPU kernels read the table ``row_tiles`` builds; the Pallas
ones compute each entry in the program that needs it (``grouped_gemm._tile_rows``), the same
table.
"""

import jax
import jax.numpy as jnp

from jtbo.core import arith


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
    # The groups that end at or before each tile, summed along each tile's row (a row
    # reduction, which XLA fuses with its compares).
    group = jnp.sum(ends[None, :] <= index[:, None], axis=1, dtype=jnp.int32)
    group = jnp.minimum(group, group_size.shape[0] - 1)
    live = index < ends[-1]
    start = group_start[group] + (index - first[group]) * block_m
    end = group_start[group] + group_size[group]
    table = [jnp.where(live, group, -1), jnp.where(live, start, 0), jnp.where(live, end, 0)]
    return jnp.stack(table).astype(jnp.int32)
