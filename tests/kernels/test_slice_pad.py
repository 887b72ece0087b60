"""slice_pad against a numpy reference, in every impl this backend serves."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import kernels
from tests.kernels import helpers


def _run(x, start, length, capacity, impl):
    helpers.poison_device_memory()
    return kernels.slice_pad(
        jnp.asarray(x), start, length, capacity=capacity, impl=impl, config=helpers.SMALL
    )


@pytest.mark.parametrize("impl", helpers.impls_here())
@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(0, 9),
    capacity=st.integers(0, 9),
    trailing=st.sampled_from(helpers.TRAILING),
    dtype=st.sampled_from(helpers.DTYPES),
    start=st.integers(-12, 12),
    length=st.integers(-2, 12),
    seed=st.integers(0, 2**16),
)
def test_matches_numpy(impl, rows, capacity, trailing, dtype, start, length, seed):
    x = helpers.random_rows(np.random.default_rng(seed), rows, trailing, dtype)
    out = _run(x, start, length, capacity, impl)
    helpers.assert_equal(out, helpers.slice_pad_np(x, start, length, capacity))


EDGES = [  # (rows, capacity, start, length)
    (8, 5, 0, 0),  # length 0: all zeros
    (8, 8, 0, 8),  # all rows
    (8, 5, 3, 5),  # ends at the last row
    (8, 5, 6, 5),  # runs past the end: tail zero
    (8, 5, -2, 4),  # negative start: leading rows zero, not shifted
    (3, 6, 0, 3),  # capacity above the rows
]


@pytest.mark.parametrize("impl", helpers.impls_here())
@pytest.mark.parametrize(("rows", "capacity", "start", "length"), EDGES)
def test_edges(impl, rows, capacity, start, length):
    x = helpers.random_rows(np.random.default_rng(rows + start), rows, (4,), np.float32)
    out = _run(x, jnp.asarray([start], jnp.int32), length, capacity, impl)
    helpers.assert_equal(out, helpers.slice_pad_np(x, start, length, capacity))


class TestVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager(self):
        x = helpers.random_rows(np.random.default_rng(0), 11, (2, 3), np.float16)
        for impl in helpers.impls_here():
            fn = self.variant(
                lambda x, s, n, impl=impl: kernels.slice_pad(
                    x, s, n, capacity=7, impl=impl, config=helpers.SMALL
                )
            )
            out = fn(jnp.asarray(x), jnp.int32(5), jnp.int32(6))
            helpers.assert_equal(out, helpers.slice_pad_np(x, 5, 6, 7))


@pytest.mark.parametrize("impl", helpers.impls_here())
def test_one_trace_across_starts(impl):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def child(x, start, length):
        return kernels.slice_pad(x, start, length, capacity=6, impl=impl, config=helpers.SMALL)

    x = helpers.random_rows(np.random.default_rng(1), 10, (3,), np.int32)
    for start, length in [(0, 6), (4, 6), (9, 3), (2, 0), (-3, 5)]:
        out = child(jnp.asarray(x), jnp.int32(start), jnp.int32(length))
        helpers.assert_equal(out, helpers.slice_pad_np(x, start, length, 6))
    chex.clear_trace_counter()


def test_static_misuse_raises():
    x = jnp.ones((4, 3), jnp.float32)
    with pytest.raises(ValueError, match="capacity must be in"):
        kernels.slice_pad(x, 0, 1, capacity=-1)
    with pytest.raises(ValueError, match="capacity must be a static"):
        kernels.slice_pad(x, 0, 1, capacity=jnp.int32(3))
    with pytest.raises(ValueError, match="row axis"):
        kernels.slice_pad(jnp.float32(1.0), 0, 1, capacity=2)
