"""Capacities and empty metadata."""

import jax
import numpy as np
import pytest

from jtbo.attention import metadata, tiling


def test_extend_capacity_bounds_any_ragged_batch():
    cap = metadata.extend_capacity(20, 4, 64, query_tile=4)
    # Worst case: 4 sequences of lengths 1, 1, 1, 17 -> 1 + 1 + 1 + 5 tiles.
    assert cap.num_tiles == 4 + 16 // 4 == 8
    for lens in ([1, 1, 1, 17], [5, 5, 5, 5], [20], [2, 3, 7, 8]):
        assert sum(-(-n // 4) for n in lens) <= cap.num_tiles


def test_decode_and_verify_capacities():
    assert metadata.decode_capacity(8, 64).num_tiles == 8
    verify = metadata.verify_capacity(8, 3, 64)
    assert (verify.token_capacity, verify.query_tile, verify.custom_mask) == (24, 3, True)


def test_capacity_validation():
    with pytest.raises(ValueError, match="query_tile"):
        metadata.AttentionCapacity(4, 4, 0, 4, 8)


def test_empty_metadata_is_a_pytree_of_static_shape():
    cap = metadata.verify_capacity(2, 3, 8)
    md = metadata.empty_metadata(cap)
    leaves = jax.tree.leaves(md)
    assert len(leaves) == 8  # capacity is static, not a leaf
    assert md.custom_mask.shape == (2, 3, 8)
    assert not any(np.asarray(x).any() for x in leaves)
    assert metadata.empty_metadata(metadata.decode_capacity(2, 8)).custom_mask is None


def test_tile_prefix_lens_is_each_sequence_s_first_position():
    # Three sequences (rows 2, 0, 1) with prefixes 3, 0 and 7, cut into tiles of 4; the
    # numpy reference takes each sequence's q_pos directly, not through the tiles.
    capacity = metadata.extend_capacity(16, 3, 24, query_tile=4)
    q_len, q_pos = np.array([5, 2, 9]), np.array([3, 0, 7])
    md = tiling.build_metadata(
        capacity, req=[2, 0, 1], q_start=[0, 5, 7], q_len=q_len, q_pos=q_pos,
        kv_len=q_pos + q_len, out_cache_loc=np.arange(1, 17), num_tokens=16,
    )  # fmt: skip
    tiles_per_seq = -(-q_len // 4)
    expected = np.zeros(capacity.num_tiles, np.int32)
    expected[: tiles_per_seq.sum()] = np.repeat(q_pos, tiles_per_seq)
    np.testing.assert_array_equal(metadata.tile_prefix_lens(md, 3), expected)
