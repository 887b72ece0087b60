"""The numpy references and the random inputs they regenerate."""

import numpy as np

from jtbo.bench import overlap


def _a2a_inputs(ndev: int = 4, rows: int = 8) -> np.ndarray:
    return np.stack([overlap.device_block(7, 0, p, (rows, 3), np.float32) for p in range(ndev)])


def test_references_move_blocks_as_the_collectives_do():
    x = _a2a_inputs(ndev=2, rows=4)  # device d, rows [block 0 (2 rows), block 1 (2 rows)]
    a2a = overlap.COLLECTIVES["all_to_all"].reference(x)
    np.testing.assert_array_equal(a2a[1, 1], x[0, 3])  # device 1 gets device 0's block 1,
    np.testing.assert_array_equal(a2a[1, 0], -x[1, 0])  # its first row the negated first
    np.testing.assert_array_equal(a2a[0, 0], -x[0, 0])  # row device 1 sent
    np.testing.assert_array_equal(a2a[0, 2:], x[1, :2])
    twice = overlap.COLLECTIVES["all_to_all"].reference(a2a)
    # Blocks back home, each first row restored from the negated one sent; device 0's row 2
    # is the row that overwrote device 1's first row on the first trip.
    expected = x.copy()
    expected[0, 2] = -x[1, 0]
    np.testing.assert_array_equal(twice, expected)
    scattered = overlap.COLLECTIVES["psum_scatter"].reference(x)
    np.testing.assert_allclose(scattered[1, :2], (x[0, 2:] + x[1, 2:]) / 2)
    gathered = overlap.COLLECTIVES["all_gather"].reference(x)
    np.testing.assert_allclose(gathered[0], x[0] / 3 + x[1] * 2 / 3, rtol=1e-6)


def test_device_block_columns_are_a_prefix_and_never_zero():
    wide = overlap.device_block(3, 0, 5, (6, overlap.COLUMNS), np.float32)
    narrow = overlap.device_block(3, 0, 5, (6, overlap.CHECK_COLUMNS), np.float32)
    np.testing.assert_array_equal(wide[:, : overlap.CHECK_COLUMNS], narrow)
    assert wide.min() >= 1 and wide.max() < 2
