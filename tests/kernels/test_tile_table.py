"""tile_table: the grouped GEMM's row-tile table and its length bound."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.kernels import tile_table


def test_row_tiles_lists_live_tiles_first():
    table = tile_table.row_tiles(
        jnp.array([0, 10, 20], jnp.int32), jnp.array([5, 0, 9], jnp.int32), 4, 6
    )
    np.testing.assert_array_equal(
        np.asarray(table),
        [[0, 0, 2, 2, 2, -1], [0, 4, 20, 24, 28, 0], [5, 5, 29, 29, 29, 0]],
    )


@settings(max_examples=30, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    block_m=st.sampled_from([4, 8, 16]),
)
def test_max_tiles_bounds_the_live_tiles(counts, block_m):
    live = sum(-(-c // block_m) for c in counts)
    bound = tile_table.max_tiles(len(counts), 40, block_m, max_rows=sum(counts))
    assert live <= bound <= tile_table.max_tiles(len(counts), 40, block_m, max_rows=None)


@settings(max_examples=20, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=6), block_m=st.sampled_from([4, 8]))
def test_tile_spans_are_each_groups_tiles_in_order(counts, block_m):
    first, ends = map(np.asarray, tile_table.tile_spans(jnp.asarray(counts, jnp.int32), block_m))
    blocks = [-(-c // block_m) for c in counts]
    np.testing.assert_array_equal(ends, np.cumsum(blocks))
    np.testing.assert_array_equal(first, np.cumsum(blocks) - blocks)


def _numpy_row_tiles(group_start, counts, block_m, num_tiles):
    """The table by a loop over the groups' tiles, dead tiles padding it."""
    table = [(e, start + i * block_m, start + count)
             for e, (start, count) in enumerate(zip(group_start, counts, strict=True))
             for i in range(-(-count // block_m))]  # fmt: skip
    table = (table + [(-1, 0, 0)] * num_tiles)[:num_tiles]
    return np.asarray(table, np.int32).T


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=7),
    block_m=st.sampled_from([4, 8, 16]),
    spare=st.integers(-3, 4),
)
def test_row_tiles_match_a_loop_over_the_groups(counts, block_m, spare):
    # Tables longer than the live tiles (dead tiles at the end) and shorter (cut off).
    group_start = np.cumsum([0] + counts[:-1]) + 3 * np.arange(len(counts))  # gaps between
    num_tiles = max(1, sum(-(-c // block_m) for c in counts) + spare)
    table = tile_table.row_tiles(
        jnp.asarray(group_start, jnp.int32), jnp.asarray(counts, jnp.int32), block_m, num_tiles
    )
    want = _numpy_row_tiles(group_start, counts, block_m, num_tiles)
    np.testing.assert_array_equal(np.asarray(table), want)
