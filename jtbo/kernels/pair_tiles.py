"""The row tiles of a grouped GEMM found from the (token, choice) pairs themselves.

The slot layout (``tile_table``, ``slot_rows``) is built before the kernels: each pair's rank
within its expert, a table of ``block_m``-row tiles, the token row in each slot. At decode
sizes each of those is a small XLA fusion of its own, and together they cost a few percent of
an expert layer that reads every expert's weights once. Here a kernel program finds its own
rows instead, from two small arrays it loads whole:

* ``counts [E2]``: rows (pairs) per expert, zero past the ``E`` experts;
* ``pair_expert [P2]``: the expert of each pair in token-major order, -1 for a pair that
  takes no row (and for the padding up to ``P2``).

Tile ``t`` of the live tiles (each expert's ``ceil(counts[e] / block_m)`` tiles, in expert
order, as ``tile_table.row_tiles`` lists them) belongs to the expert whose tile span holds it;
its row ``r`` is the pair with rank ``(t - first tile of the expert) * block_m + r`` among the
expert's pairs, ranks counted in pair order (``slot_positions``' order). Every step is a
whole-array operation (a running sum, compares, reductions) that lowers inside a Pallas
program; the cost is a ``[block_m, P2]`` compare per program, so it suits the few pairs of a
decode step.
"""

import jax
import jax.numpy as jnp

from jtbo.core import arith


def pair_counts(pair_expert: jax.Array, num_groups: int) -> jax.Array:
    """Rows per expert: ``[num_groups]`` int32 count of each expert id in ``pair_expert``
    (ids outside ``[0, num_groups)`` count nowhere).

    Args:
      pair_expert: ``[P]`` int32 expert of each pair, -1 for none.
      num_groups: the length of the result (the experts, or more: the rest count zero).

    Returns:
      ``[num_groups]`` int32.
    """
    groups = jnp.arange(num_groups, dtype=jnp.int32)
    return jnp.sum(pair_expert[None, :] == groups[:, None], axis=1, dtype=jnp.int32)


def tile_expert(counts: jax.Array, tile, block_m: int):
    """The expert of live tile ``tile`` (a traced scalar) of ``block_m``-row tiles.

    Args:
      counts: ``[E2]`` int32 rows per expert (``pair_counts``).
      tile: int32 scalar, the tile's index in the list of live tiles.
      block_m: rows per tile.

    Returns:
      ``(expert, first_rank, count)`` int32 scalars: the tile's expert (-1 past the live
      tiles), the rank among the expert's pairs of the tile's first row, and the expert's
      count (0 past the live tiles).
    """
    groups = jnp.arange(counts.shape[0], dtype=jnp.int32)
    tiles = arith.ceil_div(counts, block_m)
    ends = jnp.cumsum(tiles)
    # The experts that end at or before the tile: its expert's index (tile_table.row_tiles).
    expert = jnp.sum((ends <= tile).astype(jnp.int32))
    own = groups == expert
    first_rank = (tile - jnp.sum(jnp.where(own, ends - tiles, 0))) * block_m
    count = jnp.sum(jnp.where(own, counts, 0))
    return jnp.where(count > 0, expert, -1), first_rank, count


def tile_pairs(pair_expert: jax.Array, expert, first_rank, count, block_m: int):
    """The pairs in the rows of a tile of ``expert`` whose first row has rank ``first_rank``.

    Args:
      pair_expert: ``[P2]`` int32 expert of each pair, -1 for none.
      expert, first_rank, count: ``tile_expert``'s.
      block_m: rows per tile.

    Returns:
      ``(pair, live)``: ``[block_m]`` int32, the pair in each row (0 where the row holds
      none); ``[block_m, 1]`` bool, the rows that hold a pair.
    """
    rank = first_rank + jnp.arange(block_m, dtype=jnp.int32)
    mine = pair_expert == expert
    pair_rank = jnp.cumsum(mine.astype(jnp.int32)) - 1
    chosen = mine[None, :] & (pair_rank[None, :] == rank[:, None])  # [block_m, P2]
    pairs = jnp.arange(pair_expert.shape[0], dtype=jnp.int32)
    pair = jnp.sum(jnp.where(chosen, pairs[None, :], 0), axis=1)
    return pair, (rank < count)[:, None]
