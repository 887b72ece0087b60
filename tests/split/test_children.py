"""split_batch: SGLang cases, hypothesis properties (tiling, two-chunk invariants), purity."""

import copy
import dataclasses
from typing import Any

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings

from jtbo.split import (
    ForwardBatch,
    ForwardMode,
    compute_split_seq_index,
    plan_tbo_split,
    split_batch,
)
from jtbo.split import batch as batch_lib
from tests.split import batches


def planned(batch, threshold=0.48):
    lens = None if batch.extend_seq_lens is None else batch.extend_seq_lens.tolist()
    per_seq = {ForwardMode.DECODE: 1, ForwardMode.IDLE: 0}.get(batch.forward_mode)
    if batch.forward_mode.is_target_verify():
        per_seq = batch.spec_info.draft_token_num
    s = compute_split_seq_index(
        batch.forward_mode, batch.num_tokens, lens, per_seq, threshold=threshold
    )
    auto = plan_tbo_split(batch, threshold=threshold)
    assert auto.tbo_split_seq_index == s and batch.tbo_split_seq_index is None
    return dataclasses.replace(batch, tbo_split_seq_index=s)


def check_extend_child(child):
    """Lengths, start locations and positions of a ragged child agree row by row."""
    child.validate()  # split_batch skips the constructor's checks for derived children
    lens, prefix = child.extend_seq_lens, child.extend_prefix_lens
    assert int(lens.sum()) == child.num_tokens == child.extend_num_tokens
    np.testing.assert_array_equal(child.seq_lens, prefix + lens)
    np.testing.assert_array_equal(child.extend_start_loc, np.cumsum(lens) - lens)
    np.testing.assert_array_equal(child.positions, batches.extend_positions(lens, prefix))


def test_balanced_split_fields():
    parent = planned(batches.extend_batch([50, 1, 50], global_dp_buffer_len=256))
    a, b = split_batch(parent, attn_tp_size=4)
    assert (a.batch_size, b.batch_size) == (2, 1)
    assert a.tbo_parent_token_range == (0, 51) and b.tbo_parent_token_range == (51, 101)
    assert (a.tbo_padded_len, b.tbo_padded_len) == (52, 52)
    assert (a.num_token_non_padded, b.num_token_non_padded) == (51, 50)
    assert (a.global_dp_buffer_len, b.global_dp_buffer_len) == (51, 50)
    assert a.tbo_split_seq_index is None and a.global_num_tokens is None
    np.testing.assert_array_equal(b.extend_start_loc, [0])  # relative to the child
    np.testing.assert_array_equal(b.req_pool_indices, parent.req_pool_indices[2:])
    for child in (a, b):
        check_extend_child(child)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
def test_two_chunk_one_long_prompt(mode):
    parent = planned(batches.extend_batch([1000, 10, 10], [7, 0, 3], mode=mode))
    a, b = split_batch(parent)
    np.testing.assert_array_equal(a.extend_seq_lens, [510])
    np.testing.assert_array_equal(a.seq_lens, [517])
    np.testing.assert_array_equal(b.extend_seq_lens, [490, 10, 10])
    np.testing.assert_array_equal(b.extend_prefix_lens, [517, 0, 3])
    np.testing.assert_array_equal(b.seq_lens, parent.seq_lens)
    np.testing.assert_array_equal(b.extend_start_loc, [0, 490, 500])
    assert b.positions[0] == 517
    for child in (a, b):
        check_extend_child(child)


def test_degenerate_single_sequence():
    parent = planned(batches.extend_batch([1]))
    a, b = split_batch(parent)
    assert (a.batch_size, a.num_tokens, b.batch_size, b.num_tokens) == (0, 0, 1, 1)
    assert a.tbo_padded_len == 0


def test_decode_split():
    parent = planned(batches.decode_batch(7))
    a, b = split_batch(parent, attn_tp_size=2)
    a.validate()
    b.validate()
    assert (a.batch_size, b.batch_size) == (3, 4)
    assert (a.tbo_padded_len, b.tbo_padded_len) == (4, 4)
    np.testing.assert_array_equal(np.concatenate([a.seq_lens, b.seq_lens]), parent.seq_lens)
    assert a.extend_num_tokens is None and a.extend_seq_lens is None


def test_target_verify_with_masks():
    parent = planned(batches.verify_batch([3, 1, 4], 2))
    spec = parent.spec_info
    a, b = split_batch(parent)
    assert (a.batch_size, b.batch_size, a.num_tokens) == (1, 2, 2)
    np.testing.assert_array_equal(a.spec_info.custom_mask, spec.custom_mask[:10])
    np.testing.assert_array_equal(b.spec_info.custom_mask, spec.custom_mask[10:28])
    np.testing.assert_array_equal(b.spec_info.draft_token, spec.draft_token[2:])
    np.testing.assert_array_equal(b.spec_info.retrieve_index, spec.retrieve_index[1:])
    np.testing.assert_array_equal(a.spec_info.seq_lens, [3])
    assert a.extend_seq_lens is None and a.extend_start_loc is None


def test_target_verify_empty_range_gets_empty_mask():
    parent = planned(batches.verify_batch([5], 3))
    a, b = split_batch(parent)
    assert a.batch_size == 0 and a.spec_info.custom_mask.shape == (0,)
    np.testing.assert_array_equal(b.spec_info.custom_mask, parent.spec_info.custom_mask)


def test_idle():
    parent = ForwardBatch(
        forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=np.zeros(0), tbo_split_seq_index=0
    )
    a, b = split_batch(parent, attn_tp_size=4)
    assert (a.num_tokens, b.num_tokens, a.tbo_padded_len, b.tbo_padded_len) == (0, 0, 0, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class _BatchWithLora(ForwardBatch):
    lora_ids: Any = None  # [batch_size]


def test_unknown_set_field_raises_naming_it():
    fields = dict(
        forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=np.arange(2), tbo_split_seq_index=1
    )
    split_batch(_BatchWithLora(**fields))  # unset: fine
    with pytest.raises(ValueError, match="'lora_ids'"):
        split_batch(_BatchWithLora(**fields, lora_ids=np.arange(2)))


def test_bad_split_requests():
    parent = batches.extend_batch([4, 4])
    with pytest.raises(ValueError, match="tbo_split_seq_index, got None"):
        split_batch(parent)
    with pytest.raises(ValueError, match="attn_tp_size"):
        split_batch(planned(parent), attn_tp_size=0)
    long_prompt = dataclasses.replace(batches.extend_batch([100, 1]), tbo_split_seq_index=1)
    with pytest.raises(ValueError, match="does not hold token row 50"):
        split_batch(long_prompt)  # two-chunk cut lies in sequence 0, not 1
    no_lens = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=np.arange(3), tbo_split_seq_index=0
    )
    with pytest.raises(ValueError, match="need extend_seq_lens"):
        split_batch(no_lens)
    draft = ForwardBatch(
        forward_mode=ForwardMode.DRAFT_EXTEND,
        batch_size=1,
        input_ids=np.arange(3),
        extend_seq_lens=[3],
        tbo_split_seq_index=0,
    )
    with pytest.raises(ValueError, match="DRAFT_EXTEND"):
        split_batch(draft)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 120), min_size=1, max_size=10),
    mode=st.sampled_from([ForwardMode.EXTEND, ForwardMode.MIXED]),
    threshold=st.sampled_from([0.0, 0.3, 0.48, 0.5]),
    tp=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_extend_children_tile_parent(lens, mode, threshold, tp, seed):
    parent = planned(batches.extend_batch(lens, seed=seed, mode=mode), threshold)
    before = copy.deepcopy(parent)
    a, b = split_batch(parent, attn_tp_size=tp, threshold=threshold)
    jax.tree.map(np.testing.assert_array_equal, parent, before)  # pure: parent unchanged
    t = a.num_tokens
    assert a.tbo_parent_token_range == (0, t) and b.tbo_parent_token_range == (t, parent.num_tokens)
    for name in ("input_ids", "positions", "out_cache_loc"):
        joined = np.concatenate([getattr(a, name), getattr(b, name)])
        np.testing.assert_array_equal(joined, getattr(parent, name))
    for child in (a, b):
        assert child.tbo_padded_len % tp == 0
        assert child.num_tokens <= child.tbo_padded_len < child.num_tokens + tp
        assert child.num_token_non_padded == child.num_tokens
        check_extend_child(child)
    s = parent.tbo_split_seq_index
    overlap = a.batch_size + b.batch_size - parent.batch_size
    assert overlap in (0, 1)
    if overlap:  # two-chunk: the cut sequence appears in both, its tokens add up
        assert a.num_tokens == parent.num_tokens // 2
        assert a.extend_seq_lens[-1] + b.extend_seq_lens[0] == parent.extend_seq_lens[s]
        assert a.extend_seq_lens[-1] >= 0 and b.extend_seq_lens[0] >= 1
        assert a.req_pool_indices[-1] == b.req_pool_indices[0]
    joined_req = np.concatenate([a.req_pool_indices[: a.batch_size - overlap], b.req_pool_indices])
    np.testing.assert_array_equal(joined_req, parent.req_pool_indices)


@settings(max_examples=30, deadline=None)
@given(seq_lens=st.lists(st.integers(0, 30), max_size=9), dtn=st.integers(1, 4))
def test_verify_children_tile_parent(seq_lens, dtn):
    parent = planned(batches.verify_batch(seq_lens, dtn))
    a, b = split_batch(parent)
    a.validate()
    b.validate()
    spec = parent.spec_info
    for name in ("custom_mask", "draft_token", "positions", "retrieve_index", "seq_lens"):
        joined = np.concatenate([getattr(a.spec_info, name), getattr(b.spec_info, name)])
        np.testing.assert_array_equal(joined, getattr(spec, name))
    assert a.batch_size == len(seq_lens) // 2


def test_replace_derived_rejects_unknown_fields():
    b = batches.decode_batch(2)
    with pytest.raises(ValueError, match="no fields"):
        batch_lib.replace_derived(b, not_a_field=1)
    c = batch_lib.replace_derived(b, tbo_split_seq_index=1)
    assert c.tbo_split_seq_index == 1 and b.tbo_split_seq_index is None


def test_split_index_out_of_range_is_rejected_even_if_set_without_checks():
    b = batch_lib.replace_derived(batches.decode_batch(2), tbo_split_seq_index=3)
    with pytest.raises(ValueError, match=r"tbo_split_seq_index=3 outside \[0, batch_size=2\]"):
        split_batch(b)
