"""The host page table: slots per (request, position) and the recorded-context guard."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import split
from jtbo.runner import kv_table

ForwardMode = split.ForwardMode
MAX_REQS, MAX_CONTEXT = 4, 64
NUM_SLOTS = MAX_REQS * MAX_CONTEXT + 1


def _extend(row: int, prefix: int, new: int) -> split.ForwardBatch:
    return split.ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=np.zeros(new, np.int32),
        positions=prefix + np.arange(new), out_cache_loc=_slots(row, prefix, prefix + new),
        req_pool_indices=[row], seq_lens=[prefix + new], extend_seq_lens=[new],
        extend_prefix_lens=[prefix],
    )  # fmt: skip


def _decode(row: int, seq_len: int) -> split.ForwardBatch:
    return split.ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=1, input_ids=[0], positions=[seq_len - 1],
        out_cache_loc=_slots(row, seq_len - 1, seq_len), req_pool_indices=[row],
        seq_lens=[seq_len],
    )  # fmt: skip


def _slots(row: int, start: int, end: int) -> np.ndarray:
    return row * MAX_CONTEXT + 1 + np.arange(start, end)


def _tables():
    return np.zeros((MAX_REQS, MAX_CONTEXT), np.int32), np.zeros(MAX_REQS, np.int64)


@settings(max_examples=40, deadline=None)
@given(
    row=st.integers(0, MAX_REQS - 1),
    chunks=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    decodes=st.integers(0, 6),
)
def test_chunked_prefill_then_decode_fills_every_position(row, chunks, decodes):
    table, filled = _tables()
    length = 0
    for new in chunks:
        kv_table.record(table, _extend(row, length, new), NUM_SLOTS, filled)
        length += new
    for _ in range(decodes):
        length += 1
        kv_table.record(table, _decode(row, length), NUM_SLOTS, filled)
    assert filled[row] == length
    np.testing.assert_array_equal(table[row, :length], _slots(row, 0, length))
    assert not filled[np.arange(MAX_REQS) != row].any()


def test_a_write_past_the_recorded_context_is_refused_and_records_nothing():
    table, filled = _tables()
    kv_table.record(table, _extend(2, 0, 5), NUM_SLOTS, filled)
    with pytest.raises(ValueError, match=r"request row 2 writes KV positions from 7 .*\[0, 5\)"):
        kv_table.record(table, _decode(2, 8), NUM_SLOTS, filled)
    with pytest.raises(ValueError, match="request row 1 writes KV positions from 3"):
        kv_table.check_context(filled, _extend(1, 3, 2))
    assert filled[2] == 5 and not table[2, 5:].any()


def test_a_write_from_position_zero_starts_a_new_request():
    table, filled = _tables()
    kv_table.record(table, _extend(0, 0, 9), NUM_SLOTS, filled)
    kv_table.record(table, _extend(0, 0, 3), NUM_SLOTS, filled)  # the row's next request
    assert filled[0] == 3
    with pytest.raises(ValueError, match="from 8"):
        kv_table.check_context(filled, _decode(0, 9))


def test_write_ranges_per_mode():
    rows, starts, ends = kv_table.write_ranges(_decode(3, 10))
    assert (rows.tolist(), starts.tolist(), ends.tolist()) == ([3], [9], [10])
    rows, starts, ends = kv_table.write_ranges(_extend(1, 4, 6))
    assert (rows.tolist(), starts.tolist(), ends.tolist()) == ([1], [4], [10])
    idle = kv_table.write_ranges(
        split.ForwardBatch(forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=[])
    )
    assert all(part.size == 0 for part in idle)


def test_kv_positions_per_mode_token_by_token():
    # A two-request extend, a decode and a verify of 3 draft tokens, written out by hand.
    extend = split.ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=np.zeros(5, np.int32),
        positions=None,
        out_cache_loc=np.arange(1, 6), req_pool_indices=[3, 0], seq_lens=[4, 2],
        extend_seq_lens=[3, 2], extend_prefix_lens=[1, 0],
    )  # fmt: skip
    rows, positions = kv_table.kv_positions(extend)
    assert (rows.tolist(), positions.tolist()) == ([3, 3, 3, 0, 0], [1, 2, 3, 0, 1])
    rows, positions = kv_table.kv_positions(_decode(2, 7))
    assert (rows.tolist(), positions.tolist()) == ([2], [6])
    verify = split.ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=2, input_ids=np.zeros(6, np.int32),
        req_pool_indices=[1, 2], seq_lens=[5, 9],
        spec_info=split.SpecVerifyInput(draft_token_num=3),
    )  # fmt: skip
    rows, positions = kv_table.kv_positions(verify)
    assert (rows.tolist(), positions.tolist()) == ([1, 1, 1, 2, 2, 2], [5, 6, 7, 9, 10, 11])
