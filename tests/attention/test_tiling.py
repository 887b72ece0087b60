"""Host tiling: tiles by hand, capacity and consistency errors."""

import dataclasses

import numpy as np
import pytest

from jtbo.attention import metadata, tiling

CAP = metadata.AttentionCapacity(
    token_capacity=16, seq_capacity=3, query_tile=4, num_tiles=6, max_context=20
)


def _build(capacity=CAP, **overrides):
    rows = dict(
        req=[2, 0, 1], q_start=[0, 5, 6], q_len=[5, 1, 9], q_pos=[3, 0, 2],
        kv_len=[8, 1, 11], out_cache_loc=np.arange(1, 17), num_tokens=15,
    )  # fmt: skip
    rows.update(overrides)
    return tiling.build_metadata(capacity, **rows)


def test_tiles_by_hand():
    md = _build()
    np.testing.assert_array_equal(md.tile_req, [2, 2, 0, 1, 1, 1])
    np.testing.assert_array_equal(md.tile_q_start, [0, 4, 5, 6, 10, 14])
    np.testing.assert_array_equal(md.tile_q_len, [4, 1, 1, 4, 4, 1])
    np.testing.assert_array_equal(md.tile_q_pos, [3, 7, 0, 2, 6, 10])
    np.testing.assert_array_equal(md.tile_kv_len, [8, 8, 1, 11, 11, 11])
    np.testing.assert_array_equal(md.out_cache_loc, [*range(1, 16), 0])  # padding -> slot 0
    assert md.custom_mask is None and int(md.num_tokens) == 15


def test_unused_tiles_are_zero_and_empty_sequences_get_none():
    md = _build(q_len=[5, 0, 2], q_start=[0, 5, 5], num_tokens=7)
    np.testing.assert_array_equal(md.tile_q_len, [4, 1, 2, 0, 0, 0])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(capacity=dataclasses.replace(CAP, num_tiles=5)), "num_tiles"),
        (dict(kv_len=[8, 1, 21]), "max_context"),
        (dict(kv_len=[7, 1, 11]), "seq_lens must count"),
        (dict(num_tokens=17), "num_tokens"),
        (dict(num_tokens=12), "num_tokens"),
        (dict(q_pos=[3, -1, 2]), "negative"),
        (dict(q_start=[0, 6, 7], q_len=[5, 1, 8]), "after token 5 the next run starts at 6"),
        (dict(q_start=[0, 4, 6]), "after token 5 the next run starts at 4"),
        (dict(q_start=[1, 6, 7], q_len=[5, 1, 8], num_tokens=16),
         "after token 0 the next run starts at 1"),
        (dict(q_len=[5, 1, 8]), "after token 14 the next run starts at 15"),
        (dict(req=[0, 1, 2, 3], q_start=[0] * 4, q_len=[1] * 4, q_pos=[0] * 4, kv_len=[1] * 4),
         "seq_capacity"),
    ],
)  # fmt: skip
def test_errors_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        _build(**overrides)


def test_custom_mask_layout_and_errors():
    cap = metadata.verify_capacity(2, 2, 6)
    rows = [np.array([[1, 0, 1], [0, 1, 1]], bool), np.array([[1, 1, 0, 1], [1, 0, 0, 1]], bool)]
    md = tiling.build_metadata(
        cap, req=[0, 1], q_start=[0, 2], q_len=[2, 2], q_pos=[1, 2], kv_len=[3, 4],
        out_cache_loc=[1, 2, 3, 4], num_tokens=4, mask_rows=rows,
    )  # fmt: skip
    np.testing.assert_array_equal(md.custom_mask[1, :, :4], rows[1])
    assert not md.custom_mask[0, :, 3:].any()
    with pytest.raises(ValueError, match="mask_rows\\[1\\]"):
        tiling.build_metadata(
            cap, req=[0, 1], q_start=[0, 2], q_len=[2, 2], q_pos=[1, 2], kv_len=[3, 4],
            out_cache_loc=[1, 2, 3, 4], num_tokens=4, mask_rows=[rows[0], rows[0]],
        )  # fmt: skip
    with pytest.raises(ValueError, match="mask_rows given"):
        _build(mask_rows=[])
