"""merge_rows against a numpy reference, in every impl this backend serves."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import kernels
from tests.kernels import helpers


def _run(parts, starts, lengths, out_len, impl):
    helpers.poison_device_memory()
    return kernels.merge_rows(
        [jnp.asarray(p) for p in parts], starts, lengths,
        out_len=out_len, impl=impl, config=helpers.SMALL,
    )  # fmt: skip


@pytest.mark.parametrize("impl", helpers.impls_here())
@settings(max_examples=12, deadline=None)
@given(
    part_rows=st.lists(st.integers(0, 7), min_size=1, max_size=3),
    out_len=st.integers(0, 12),
    trailing=st.sampled_from(helpers.TRAILING),
    dtype=st.sampled_from(helpers.DTYPES),
    data=st.data(),
)
def test_matches_numpy(impl, part_rows, out_len, trailing, dtype, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    parts = [helpers.random_rows(rng, n, trailing, dtype) for n in part_rows]
    starts = data.draw(st.lists(st.integers(-8, 14), min_size=len(parts), max_size=len(parts)))
    lengths = data.draw(st.lists(st.integers(-2, 9), min_size=len(parts), max_size=len(parts)))
    out = _run(parts, starts, lengths, out_len, impl)
    helpers.assert_equal(out, helpers.merge_np(parts, starts, lengths, out_len))


EDGES = [  # (part rows, starts, lengths, out_len)
    ((5, 5), (0, 4), (4, 5), 9),  # the TBO case: children tile the parent
    ((5, 5), (0, 4), (4, 3), 9),  # padded children: only the valid rows land
    ((5, 5), (0, 2), (5, 5), 8),  # overlap: the later part wins
    ((5, 5), (0, 0), (0, 0), 6),  # nothing: all zeros
    ((4, 6), (7, -3), (4, 6), 9),  # one part past the end, one before the start
    ((3, 3, 3, 3, 3), (0, 3, 6, 9, 12), (3, 3, 3, 3, 3), 15),  # more than two parts
]


@pytest.mark.parametrize("impl", helpers.impls_here())
@pytest.mark.parametrize(("part_rows", "starts", "lengths", "out_len"), EDGES)
def test_edges(impl, part_rows, starts, lengths, out_len):
    rng = np.random.default_rng(out_len)
    parts = [helpers.random_rows(rng, n, (4,), np.float32) for n in part_rows]
    out = _run(parts, jnp.asarray(starts, jnp.int32), lengths, out_len, impl)
    helpers.assert_equal(out, helpers.merge_np(parts, starts, lengths, out_len))


class TestVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager(self):
        rng = np.random.default_rng(0)
        parts = [helpers.random_rows(rng, 6, (2, 3), jnp.bfloat16) for _ in range(2)]
        for impl in helpers.impls_here():
            fn = self.variant(
                lambda a, b, s, n, impl=impl: kernels.merge_rows(
                    [a, b], s, n, out_len=11, impl=impl, config=helpers.SMALL
                )
            )
            out = fn(*map(jnp.asarray, parts), jnp.asarray([0, 5]), jnp.asarray([5, 6]))
            helpers.assert_equal(out, helpers.merge_np(parts, [0, 5], [5, 6], 11))


@pytest.mark.parametrize("impl", helpers.impls_here())
def test_one_trace_across_splits(impl):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def merge(a, b, starts, lengths):
        return kernels.merge_rows([a, b], starts, lengths, out_len=10, impl=impl,
                                  config=helpers.SMALL)  # fmt: skip

    rng = np.random.default_rng(1)
    a, b = (helpers.random_rows(rng, 6, (3,), np.int32) for _ in range(2))
    for split in [0, 3, 5, 6]:
        starts, lengths = [0, split], [split, 10 - split]
        out = merge(jnp.asarray(a), jnp.asarray(b), jnp.asarray(starts), jnp.asarray(lengths))
        helpers.assert_equal(out, helpers.merge_np([a, b], starts, lengths, 10))
    chex.clear_trace_counter()


def test_static_misuse_raises():
    a = jnp.ones((4, 3), jnp.float32)
    with pytest.raises(ValueError, match="at least one part"):
        kernels.merge_rows([], [], [], out_len=3)
    with pytest.raises(ValueError, match="trailing shape"):
        kernels.merge_rows([a, jnp.ones((4, 2), jnp.float32)], [0, 4], [4, 4], out_len=8)
    with pytest.raises(ValueError, match="one entry per part"):
        kernels.merge_rows([a, a], [0], [4, 4], out_len=8)
    with pytest.raises(ValueError, match="out_len must be in"):
        kernels.merge_rows([a], [0], [4], out_len=-2)
