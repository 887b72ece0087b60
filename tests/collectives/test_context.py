"""DpContext construction checks and local start/length in the graph."""

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
