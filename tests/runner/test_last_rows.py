"""last_rows: each sequence's last token row and the padded index."""

import types

import numpy as np
import pytest

from jtbo import split
from jtbo.runner import last_rows
from tests.runner import helpers


def test_extend_rows_are_each_sequence_last_token():
    batch = helpers.Rank().extend({0: [5, 6, 7], 3: [8], 1: [9, 10]})  # rows sorted: 0, 1, 3
    np.testing.assert_array_equal(last_rows.last_rows(batch), [2, 4, 5])


def test_decode_rows_are_every_row():
    rank = helpers.Rank()
    rank.extend({0: [1, 2], 2: [3]})
    np.testing.assert_array_equal(last_rows.last_rows(rank.decode({0: 4, 2: 5})), [0, 1])


def test_verify_and_empty_sequences_are_refused():
    # Only the fields last_rows reads (ForwardBatch itself refuses an empty sequence).
    def batch(mode, lens):
        return types.SimpleNamespace(
            forward_mode=mode, batch_size=len(lens), extend_seq_lens=np.array(lens),
            extend_start_loc=np.cumsum([0, *lens[:-1]]),
        )  # fmt: skip

    with pytest.raises(ValueError, match="TARGET_VERIFY"):
        last_rows.last_rows(batch(split.ForwardMode.TARGET_VERIFY, [3, 3]))
    with pytest.raises(ValueError, match="new token"):
        last_rows.last_rows(batch(split.ForwardMode.EXTEND, [3, 0]))
    with pytest.raises(ValueError, match="PREBUILT"):
        last_rows.last_rows(batch(split.ForwardMode.PREBUILT, [2]))
    idle = last_rows.last_rows(batch(split.ForwardMode.IDLE, []))
    assert idle.shape == (0,) and idle.dtype == np.int32


def test_row_index_pads_with_row_zero_and_refuses_too_many_rows():
    index = last_rows.row_index([np.array([4, 9]), np.zeros(0, np.int32)], 4)
    np.testing.assert_array_equal(index, [[4, 9, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="exceed"):
        last_rows.row_index([np.arange(5)], 4)
