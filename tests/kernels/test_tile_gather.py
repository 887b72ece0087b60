"""gather_tiles: the live tiles' rows (xla and pallas; the Pallas interpreter on the CPU)
against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo import kernels
from jtbo.kernels import tile_gather

SMALL = tile_gather.TileGatherConfig(block_rows=4, block_cols=16)


def _case(seed: int):
    rng = np.random.default_rng(seed)
    rows = jax.random.normal(jax.random.key(seed), (10, 48), jnp.float32)
    tile_expert = np.array([2, 0, -1, 1], np.int32)  # tile 2 dead
    source = rng.integers(-1, 10, 4 * 8).astype(np.int32)  # 8-row tiles, -1: a zero row
    return rows, jnp.asarray(source), jnp.asarray(tile_expert)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_live_tiles_hold_their_source_rows(impl):
    rows, source, tile_expert = _case(0)
    got = np.asarray(
        tile_gather.gather_tiles(rows, source, tile_expert, 8, impl=impl, config=SMALL)
    )
    want = np.where(np.asarray(source)[:, None] >= 0, np.asarray(rows)[np.asarray(source)], 0)
    live = np.repeat(np.asarray(tile_expert) >= 0, 8)
    np.testing.assert_array_equal(got[live], want[live])


def test_bad_shapes_and_impls_are_refused():
    rows, source, tile_expert = _case(2)
    with pytest.raises(ValueError, match="source \\[num_tiles \\* 4\\]"):
        tile_gather.gather_tiles(rows, source, tile_expert, 4)
    with pytest.raises(kernels.KernelUnavailableError, match="impl='triton'"):
        tile_gather.gather_tiles(rows, source, tile_expert, 8, impl="triton")
    with pytest.raises(ValueError, match="block_rows 8 must divide"):
        tile_gather.gather_tiles_pallas(
            rows, source, tile_expert, 12, tile_gather.TileGatherConfig(block_rows=8), True
        )
