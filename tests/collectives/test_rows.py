"""Row helpers: group ranks and sizes against a numpy reference, the int32 column packing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.collectives import rows


def _rank_reference(group: np.ndarray, num_groups: int) -> np.ndarray:
    seen = {}
    out = np.zeros(len(group), np.int32)
    for i, g in enumerate(group.tolist()):
        if 0 <= g < num_groups:
            out[i] = seen.get(g, 0)
            seen[g] = out[i] + 1
    return out


@settings(max_examples=30, deadline=None)
@given(data=st.data(), num_groups=st.integers(1, 9))
def test_rank_within_group_matches_numpy(data, num_groups):
    values = data.draw(st.lists(st.integers(-1, num_groups), min_size=1, max_size=40))
    group = np.asarray(values, np.int32)
    got = rows.rank_within_group(jnp.asarray(group), num_groups)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), _rank_reference(group, num_groups))


# Jitted once per example's shapes: eagerly, each of their operations compiled for every new
# shape the examples draw.
_group_ranks = jax.jit(rows.group_ranks, static_argnums=1, static_argnames="block")
_rank_within_group = jax.jit(rows.rank_within_group, static_argnums=1)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_groups=st.integers(1, 9), block=st.sampled_from([1, 2, 3, 8, 128]))
def test_group_ranks_match_numpy_over_blocks(data, num_groups, block):
    # Small blocks put the running count across many blocks (and a padded last one).
    values = data.draw(st.lists(st.integers(-2, num_groups + 1), min_size=1, max_size=70))
    group = np.asarray(values, np.int32)
    rank, sizes = _group_ranks(jnp.asarray(group), num_groups, block=block)
    assert rank.dtype == sizes.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(rank), _rank_reference(group, num_groups))
    in_group = group[(group >= 0) & (group < num_groups)]
    expected = np.bincount(in_group, minlength=num_groups)
    np.testing.assert_array_equal(np.asarray(sizes), expected)
    one_hot = _rank_within_group(jnp.asarray(group), num_groups)
    np.testing.assert_array_equal(np.asarray(one_hot), np.asarray(rank))


def test_group_ranks_of_many_elements_under_jit():
    # The shape of a prefill's routing: thousands of pairs over 128 experts, several blocks.
    rng = np.random.default_rng(11)
    group = rng.integers(-1, 129, 5000).astype(np.int32)
    rank, sizes = jax.jit(rows.group_ranks, static_argnums=1)(jnp.asarray(group), 128)
    np.testing.assert_array_equal(np.asarray(rank), _rank_reference(group, 128))
    np.testing.assert_array_equal(
        np.asarray(sizes), np.bincount(group[(group >= 0) & (group < 128)], minlength=128)
    )


def test_group_ranks_of_no_elements():
    rank, sizes = rows.group_ranks(jnp.zeros((0,), jnp.int32), 3)
    assert rank.shape == (0,)
    np.testing.assert_array_equal(np.asarray(sizes), [0, 0, 0])


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32])
def test_rank_within_group_example(dtype):
    group = jnp.asarray([2, 0, 2, 3, 2, 0], dtype)  # 3 == num_groups: no group
    got = rows.rank_within_group(group, 3)
    np.testing.assert_array_equal(np.asarray(got), [0, 0, 1, 0, 2, 1])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8])
def test_pack_int32_columns_round_trip_is_bit_exact(dtype):
    # Ids and float32 weights (NaN and -0.0 bit patterns included) come back bit for bit.
    rng = np.random.default_rng(2)
    rows_in = jnp.asarray(rng.integers(-50, 50, (5, 3)), dtype)
    ids = np.array([[-1, 7], [2**31 - 1, 0], [-(2**31), 3], [12, -12], [1, 1]], np.int32)
    weights = np.array([[0.5, np.nan], [-0.0, 1e-30], [3.0, -2.5], [np.inf, 1], [0, 2]], np.float32)
    side = np.concatenate([ids, weights.view(np.int32)], axis=1)
    payload = rows.pack_int32_columns(rows_in, jnp.asarray(side))
    assert payload.shape == (5, 3 + 4 * (4 // jnp.dtype(dtype).itemsize)) and payload.dtype == dtype
    got_rows, got_side = rows.unpack_int32_columns(payload, 3)
    np.testing.assert_array_equal(np.asarray(got_side), side)
    np.testing.assert_array_equal(np.asarray(got_rows), np.asarray(rows_in))


def test_pack_int32_columns_refuses_values_that_are_not_int32():
    with pytest.raises(ValueError, match="at most 4 bytes"):
        rows.pack_int32_columns(jnp.zeros((2, 3), jnp.int8), jnp.zeros((2, 1), jnp.int16))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8])
def test_pack_int32_columns_one_id_per_row_is_bit_exact(dtype):
    # Every int32 bit pattern must survive the bitcast into row columns, including the ones
    # that are NaNs in a float dtype (-1, the empty-slot marker) and the extremes.
    rng = np.random.default_rng(5)
    rows_in = jnp.asarray(rng.integers(-100, 100, (7, 5)), dtype)
    ids = np.array([-1, 0, 1, 2**31 - 1, -(2**31), 12345, -777], np.int32)
    payload = rows.pack_int32_columns(rows_in, jnp.asarray(ids)[:, None])
    assert payload.dtype == rows_in.dtype
    assert payload.shape == (7, 5 + max(1, 4 // jnp.dtype(dtype).itemsize))
    got_rows, got_ids = rows.unpack_int32_columns(payload, 5)
    np.testing.assert_array_equal(np.asarray(got_ids)[:, 0], ids)
    np.testing.assert_array_equal(
        np.asarray(got_rows).view(np.uint8), np.asarray(rows_in).view(np.uint8)
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_pack_int32_columns_round_trips_several_ids_per_row(dtype):
    rng = np.random.default_rng(3)
    rows_in = jnp.asarray(rng.standard_normal((5, 3)), dtype)
    ids = rng.integers(-(2**31), 2**31 - 1, (5, 4), dtype=np.int64).astype(np.int32)
    ids[0] = -1
    payload = rows.pack_int32_columns(rows_in, jnp.asarray(ids))
    got_rows, got_ids = rows.unpack_int32_columns(payload, 3)
    np.testing.assert_array_equal(np.asarray(got_ids), ids)
    np.testing.assert_array_equal(
        np.asarray(got_rows).view(np.uint8), np.asarray(rows_in).view(np.uint8)
    )


def test_pack_int32_columns_widens_values_for_wide_rows():
    # float64 rows hold one widened column per value; the int32 bits come back unchanged.
    with jax.enable_x64(True):
        rows_in = jnp.asarray(np.random.default_rng(4).standard_normal((3, 2)), jnp.float64)
        ids = jnp.asarray([[-1, 2**31 - 1], [-(2**31), 0], [7, -7]], jnp.int32)
        payload = rows.pack_int32_columns(rows_in, ids)
        assert payload.shape == (3, 4) and payload.dtype == jnp.float64
        got_rows, got_ids = rows.unpack_int32_columns(payload, 2)
        np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids))
        np.testing.assert_array_equal(np.asarray(got_rows), np.asarray(rows_in))


@pytest.mark.parametrize(
    "dtype, row_shape", [(jnp.float32, (3,)), (jnp.bfloat16, (3,)), (jnp.int8, (2, 3))]
)
def test_int_words_round_trip_and_integer_sums_keep_every_bit(dtype, row_shape):
    # -0.0, NaN payloads and denormals (small ids bitcast into rows) survive an integer sum
    # with zero words, which a float sum would not (-0.0 + 0.0 == 0.0).
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 256, (4, int(np.prod(row_shape)) * jnp.dtype(dtype).itemsize))
    bits[0, : jnp.dtype(dtype).itemsize] = [0] * (jnp.dtype(dtype).itemsize - 1) + [0x80]
    x = jnp.asarray(np.frombuffer(bits.astype(np.uint8).tobytes(), dtype).reshape(4, *row_shape))
    words = rows.as_int_words(x)
    assert words.dtype == jnp.int32 and words.shape[0] == 4
    summed = words + jnp.zeros_like(words)
    back = rows.from_int_words(summed, row_shape, dtype)
    assert back.dtype == dtype and back.shape == x.shape
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), np.asarray(x).view(np.uint8))
