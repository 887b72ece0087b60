"""The shared window rule against brute force over every pair."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.kernels import ranges
from tests.kernels import helpers


@settings(max_examples=200, deadline=None)
@given(
    offset=st.integers(-(2**31), 2**31 - 1),
    size=st.integers(-(2**31), 2**31 - 1),
    plain_rows=st.integers(0, 40),
    offset_rows=st.integers(0, 40),
)
def test_window_is_exactly_the_valid_pairs(offset, size, plain_rows, offset_rows):
    off, lo, hi = np.asarray(
        ranges.copy_window(jnp.int32(offset), jnp.int32(size), plain_rows, offset_rows)
    )
    size = min(size, plain_rows + 1)  # brute force over a bounded range
    expected = [i for i, _ in helpers.pairs(offset, size, plain_rows, offset_rows)]
    assert list(range(lo, hi)) == expected
    assert all(off + i == offset + i for i in expected)
