"""Block-scaled FP8: quantize / dequantize against the block-by-block numpy definitions.

Random weights of several shapes, with dimensions that are not multiples of their block (the
last block of an axis is shorter). Tolerance of the round trip, per element, stated by the
module: e4m3 keeps 3 mantissa bits, so ``|q * s - w| <= max(2**-4 |w|, 2**-10 s)`` (the second
term for values that land in e4m3's subnormal range).
"""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.kernels import fp8_blocks

SHAPES_AND_BLOCKS = [
    ((40, 24), (16, 8)),  # 40 = 2 x 16 + 8: a short last row block
    ((3, 20, 2, 12), (1, 8, 1, 5)),  # w_gate_up-like: [E, K, 2, N], both block axes ragged
    ((2, 12, 33), (1, 4, 32)),  # w_down-like: one column past a whole block
    ((130, 129), (128, 128)),  # DeepSeek's blocks, ragged in both axes
]


def _weight(rng, shape):
    """Normal values over several orders of magnitude, with one all-zero row."""
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 3, shape))
    w[(0,) * (len(shape) - 1)] = 0.0
    return w.astype(np.float32)


def _bound(w: np.ndarray, scales: np.ndarray, block_shape) -> np.ndarray:
    expanded = fp8_blocks.dequantize_blocks_reference(
        np.ones(w.shape, ml_dtypes.float8_e4m3fn), scales, block_shape
    )
    return np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * expanded)


@pytest.mark.parametrize(("shape", "block_shape"), SHAPES_AND_BLOCKS)
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_quantize_matches_the_block_by_block_definition(shape, block_shape, seed):
    w = _weight(np.random.default_rng(seed), shape)
    want_values, want_scales = fp8_blocks.quantize_blocks_reference(w, block_shape)
    got = fp8_blocks.quantize_blocks(jnp.asarray(w), block_shape)
    got.check()
    assert got.values.dtype == jnp.float8_e4m3fn and got.scales.dtype == jnp.float32
    assert got.scales.shape == tuple(-(-s // b) for s, b in zip(shape, block_shape, strict=True))
    np.testing.assert_array_equal(np.asarray(got.scales), want_scales)
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), want_values.view(np.uint8))
    host_values, host_scales = fp8_blocks.quantize_blocks_host(w, block_shape)
    np.testing.assert_array_equal(host_scales, want_scales)
    np.testing.assert_array_equal(host_values.view(np.uint8), want_values.view(np.uint8))
    np.testing.assert_array_equal(fp8_blocks.block_scales_host(w, block_shape), want_scales)


@pytest.mark.parametrize(("shape", "block_shape"), SHAPES_AND_BLOCKS)
def test_round_trip_is_within_e4m3_rounding(shape, block_shape):
    w = _weight(np.random.default_rng(sum(shape)), shape)
    q = fp8_blocks.quantize_blocks(jnp.asarray(w), block_shape)
    back = np.asarray(fp8_blocks.dequantize_blocks(q), np.float64)
    want = fp8_blocks.dequantize_blocks_reference(np.asarray(q.values), np.asarray(q.scales),
                                                   block_shape)  # fmt: skip
    np.testing.assert_allclose(back, want, rtol=2e-7, atol=0)  # one float32 rounding
    error = np.abs(back - w)
    assert (error <= _bound(w, np.asarray(q.scales), block_shape)).all()
    # Each block's largest magnitude maps to e4m3's largest value, 448, exactly.
    values = np.abs(np.asarray(q.values, np.float32))
    for index, part in fp8_blocks._block_slices(shape, block_shape):
        if np.abs(w[part]).max() > 0:
            assert values[part].max() == 448.0, index
    zero_row = (0,) * (len(shape) - 1)
    assert not back[zero_row].any()  # an all-zero row stays zero


def test_bound_is_tight_enough_to_catch_a_wrong_scale():
    # The same check with the scales off by one block fails: the test can fail.
    w = _weight(np.random.default_rng(1), (40, 24))
    q = fp8_blocks.quantize_blocks(jnp.asarray(w), (16, 8))
    shifted = fp8_blocks.BlockQuantized(q.values, jnp.roll(q.scales, 1, axis=1), (16, 8))
    error = np.abs(np.asarray(fp8_blocks.dequantize_blocks(shifted)) - w)
    assert not (error <= _bound(w, np.asarray(q.scales), (16, 8))).all()


def test_dequantize_returns_the_dtype_asked_for_and_traces():
    w = _weight(np.random.default_rng(2), (3, 20, 2, 12))
    block_shape = fp8_blocks.expert_block_shape(4, (8, 5))
    assert block_shape == (1, 8, 1, 5)
    q = jax.jit(fp8_blocks.quantize_blocks, static_argnums=1)(jnp.asarray(w), block_shape)
    bf16 = jax.jit(lambda q: fp8_blocks.dequantize_blocks(q, jnp.bfloat16))(q)
    assert bf16.dtype == jnp.bfloat16
    chex.assert_trees_all_close(bf16.astype(jnp.float32), fp8_blocks.dequantize_blocks(q),
                                rtol=2**-8, atol=0)  # fmt: skip
    leaves, treedef = jax.tree.flatten(q)
    assert len(leaves) == 2 and jax.tree.unflatten(treedef, leaves).block_shape == block_shape


def test_bad_inputs_raise():
    w = jnp.ones((4, 6))
    with pytest.raises(ValueError, match="block_shape"):
        fp8_blocks.quantize_blocks(w, (2,))
    with pytest.raises(ValueError, match="block_shape"):
        fp8_blocks.quantize_blocks(w, (2, 0))
    with pytest.raises(ValueError, match="float weight"):
        fp8_blocks.quantize_blocks(jnp.ones((4, 6), jnp.int32), (2, 2))
    q = fp8_blocks.quantize_blocks(w, (2, 4))
    with pytest.raises(ValueError, match=r"scales must be float32 \[2, 2\]"):
        fp8_blocks.BlockQuantized(q.values, q.scales[:, :1], (2, 4)).check()
    with pytest.raises(ValueError, match="values must be float8_e4m3fn"):
        fp8_blocks.BlockQuantized(w, q.scales, (2, 4)).check()
