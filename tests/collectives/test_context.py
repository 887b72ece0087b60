"""DpContext construction checks and local start/length in the graph."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from jtbo.collectives import context as context_lib
from jtbo.collectives import padding
from tests.collectives import harness

MAX, SUM = padding.DpPaddingMode.MAX_LEN, padding.DpPaddingMode.SUM_LEN


def _local_info(context, dummy):
    start, count = context_lib.get_dp_local_info(context)
    return start.reshape(1), count.reshape(1)


@pytest.mark.parametrize("mode", [MAX, SUM], ids=lambda m: m.name)
def test_local_info(mode):
    counts = [3, 0, 4, 1]
    context = context_lib.create_dp_context(counts, mode, 4, attn_tp_size=2)
    start, count = harness.sharded(_local_info, 4, 2, 1, 2)(context, np.zeros((8, 1)))
    ranks = np.arange(8) // 2
    np.testing.assert_array_equal(count, np.asarray(counts)[ranks])
    want_start = ranks * 4 if mode.is_max_len() else np.asarray([0, 3, 3, 7])[ranks]
    np.testing.assert_array_equal(start, want_start)


def test_default_buffer_lengths():
    assert context_lib.create_dp_context([3, 1], MAX, 4).global_buffer_len == 8
    assert context_lib.create_dp_context([3, 2], SUM, 4, attn_tp_size=2).global_buffer_len == 6
    assert context_lib.create_dp_context([0, 0], SUM, 4).global_buffer_len == 1
    # A bucketed sum (17 -> 20) and its MAX_LEN cap (3 x 8 = 24 < bucket(23) = 24 is equal).
    assert context_lib.create_dp_context([8, 8, 1], SUM, 8).global_buffer_len == 20
    assert context_lib.create_dp_context([8, 8, 7], SUM, 8).global_buffer_len == 24
    assert context_lib.create_dp_context([8, 7, 7], SUM, 8, attn_tp_size=4).global_buffer_len == 24


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(total=st.integers(0, 1 << 20), attn_tp_size=st.sampled_from([1, 2, 3, 8]))
def test_sum_len_bucket_holds_the_sum_pads_under_a_quarter(total, attn_tp_size):
    got = context_lib.sum_len_bucket(total, attn_tp_size)
    assert got >= max(total, 1) and got % attn_tp_size == 0
    assert got - total < max(total, 4) / 4 + attn_tp_size
    if attn_tp_size & (attn_tp_size - 1) == 0:  # a power of two: a bucket is its own bucket
        assert context_lib.sum_len_bucket(got, attn_tp_size) == got


def test_sum_len_buckets_are_four_per_power_of_two():
    for k in range(3, 14):
        lengths = {context_lib.sum_len_bucket(t) for t in range(2**k + 1, 2 ** (k + 1) + 1)}
        assert sorted(lengths) == [2**k + j * 2 ** (k - 2) for j in range(1, 5)]
    with pytest.raises(ValueError, match="total=-1"):
        context_lib.sum_len_bucket(-1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_num_tokens=[5, 1], padding_mode=MAX, local_capacity=4), "local_capacity=4"),
        (dict(global_num_tokens=[1], padding_mode=MAX, local_capacity=3, attn_tp_size=2), "3"),
        (
            dict(global_num_tokens=[2, 2], padding_mode=MAX, local_capacity=4, global_buffer_len=4),
            "global_buffer_len=4",
        ),
        (
            dict(global_num_tokens=[2, 2], padding_mode=SUM, local_capacity=4, global_buffer_len=3),
            "below the token sum 4",
        ),
    ],
)
def test_bad_contexts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        context_lib.create_dp_context(**kwargs)


def test_context_must_match_mesh():
    context = context_lib.create_dp_context([1, 1], MAX, 4)
    with pytest.raises(ValueError, match="mesh has dp=4"):
        harness.sharded(_local_info, 4, 2, 1, 2)(context, np.zeros((8, 1)))
