"""dp_memcpy against a numpy reference, in every impl this backend serves."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import kernels
from tests.kernels import helpers


@pytest.mark.parametrize("impl", helpers.impls_here())
@settings(max_examples=12, deadline=None)
@given(
    dst_rows=st.integers(0, 9),
    src_rows=st.integers(0, 9),
    trailing=st.sampled_from(helpers.TRAILING),
    dtype=st.sampled_from(helpers.DTYPES),
    offset=st.integers(-12, 12),
    size=st.integers(-2, 12),
    offset_src=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_numpy(impl, dst_rows, src_rows, trailing, dtype, offset, size, offset_src, seed):
    rng = np.random.default_rng(seed)
    dst = helpers.random_rows(rng, dst_rows, trailing, dtype)
    src = helpers.random_rows(rng, src_rows, trailing, dtype)
    out = kernels.dp_memcpy(
        jnp.asarray(dst), jnp.asarray(src), offset, size,
        offset_src=offset_src, impl=impl, config=helpers.SMALL,
    )  # fmt: skip
    helpers.assert_equal(out, helpers.memcpy_np(dst, src, offset, size, offset_src))


EDGES = [  # (dst_rows, src_rows, offset, size)
    (8, 5, 0, 0),  # size 0
    (8, 5, 0, 5),  # size = all source rows, offset at the start
    (8, 5, 3, 5),  # offset at the end: the last row of dst is written
    (8, 5, 4, 5),  # one row past the end: dropped
    (5, 5, 0, 5),  # all rows
    (8, 5, -2, 5),  # negative offset: leading pairs dropped
]


@pytest.mark.parametrize("impl", helpers.impls_here())
@pytest.mark.parametrize("offset_src", [False, True])
@pytest.mark.parametrize(("dst_rows", "src_rows", "offset", "size"), EDGES)
def test_edges(impl, offset_src, dst_rows, src_rows, offset, size):
    rng = np.random.default_rng(dst_rows * 100 + offset)
    if offset_src:
        dst_rows, src_rows = src_rows, dst_rows
    dst = helpers.random_rows(rng, dst_rows, (4,), np.float32)
    src = helpers.random_rows(rng, src_rows, (4,), np.float32)
    offset_arr = jnp.asarray([offset], jnp.int32)  # shape (1,) is accepted too
    out = kernels.dp_memcpy(jnp.asarray(dst), jnp.asarray(src), offset_arr, size,
                            offset_src=offset_src, impl=impl, config=helpers.SMALL)  # fmt: skip
    helpers.assert_equal(out, helpers.memcpy_np(dst, src, offset, size, offset_src))


class TestVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager(self):
        rng = np.random.default_rng(0)
        dst = helpers.random_rows(rng, 12, (2, 3), np.float32)
        src = helpers.random_rows(rng, 7, (2, 3), np.float32)
        for impl in helpers.impls_here():
            fn = self.variant(
                lambda d, s, o, n, impl=impl: kernels.dp_memcpy(
                    d, s, o, n, offset_src=False, impl=impl, config=helpers.SMALL
                )
            )
            out = fn(jnp.asarray(dst), jnp.asarray(src), jnp.int32(4), jnp.int32(6))
            helpers.assert_equal(out, helpers.memcpy_np(dst, src, 4, 6, False))


@pytest.mark.parametrize("impl", helpers.impls_here())
def test_one_trace_across_offsets(impl):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def copy(dst, src, offset, size):
        return kernels.dp_memcpy(dst, src, offset, size, offset_src=True, impl=impl,
                                 config=helpers.SMALL)  # fmt: skip

    rng = np.random.default_rng(1)
    dst = helpers.random_rows(rng, 6, (3,), np.int32)
    src = helpers.random_rows(rng, 10, (3,), np.int32)
    for offset, size in [(0, 6), (4, 6), (9, 1), (3, 0), (-1, 3)]:
        out = copy(jnp.asarray(dst), jnp.asarray(src), jnp.int32(offset), jnp.int32(size))
        helpers.assert_equal(out, helpers.memcpy_np(dst, src, offset, size, True))
    chex.clear_trace_counter()


@pytest.mark.skipif(not hasattr(jax, "enable_x64"), reason="needs jax.enable_x64")
@pytest.mark.parametrize("impl", helpers.impls_here())
def test_int64_with_x64(impl):
    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        dst = rng.integers(-(2**62), 2**62, size=(7, 3), dtype=np.int64)
        src = rng.integers(-(2**62), 2**62, size=(5, 3), dtype=np.int64)
        out = kernels.dp_memcpy(jnp.asarray(dst), jnp.asarray(src), 3, 4, offset_src=False,
                                impl=impl, config=helpers.SMALL)  # fmt: skip
        helpers.assert_equal(out, helpers.memcpy_np(dst, src, 3, 4, False))


def test_static_misuse_raises():
    a = jnp.ones((4, 3), jnp.float32)
    with pytest.raises(ValueError, match="trailing shape"):
        kernels.dp_memcpy(a, jnp.ones((4, 2), jnp.float32), 0, 1, offset_src=True)
    with pytest.raises(ValueError, match="dtype"):
        kernels.dp_memcpy(a, jnp.ones((4, 3), jnp.int32), 0, 1, offset_src=True)
    with pytest.raises(ValueError, match="offset must have shape"):
        kernels.dp_memcpy(a, a, jnp.zeros((2,), jnp.int32), 1, offset_src=True)
    with pytest.raises(ValueError, match="size must be an integer"):
        kernels.dp_memcpy(a, a, 0, 1.5, offset_src=True)
    with pytest.raises(ValueError, match="impl must be one of"):
        kernels.dp_memcpy(a, a, 0, 1, offset_src=True, impl="cuda")
