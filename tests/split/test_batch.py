"""ForwardBatch / SpecVerifyInput: derived fields, pytree behaviour, bad-input ValueErrors."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.split import ForwardBatch, ForwardMode, SpecVerifyInput
from tests.split import batches


def test_derived_fields_and_defaults():
    b = batches.extend_batch([3, 5, 2], [0, 1, 2])
    np.testing.assert_array_equal(b.extend_start_loc, [0, 3, 8])
    assert b.extend_num_tokens == 10
    assert b.spec_info is None and b.tbo_split_seq_index is None
    assert b.num_tokens == 10 and b.num_valid_tokens == 10
    d = batches.decode_batch(4)
    assert d.extend_num_tokens is None and d.extend_start_loc is None


def test_lists_become_arrays():
    b = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=[5, 6, 7], extend_seq_lens=[1, 2]
    )
    assert isinstance(b.input_ids, np.ndarray) and b.input_ids.dtype == np.int32
    np.testing.assert_array_equal(b.extend_start_loc, [0, 1])


def test_pytree_static_and_data_fields():
    b = batches.extend_batch([3, 4], tbo_split_seq_index=1, num_token_non_padded=7)
    leaves, treedef = jax.tree.flatten(b)
    b2 = batches.extend_batch([4, 3], seed=1, tbo_split_seq_index=0, num_token_non_padded=7)
    # Per-step values are data: same treedef for a different split and different lengths.
    assert jax.tree.structure(b2) == treedef
    chex.assert_trees_all_equal(jax.tree.unflatten(treedef, leaves), b)
    other = batches.extend_batch([3, 4, 1])
    assert jax.tree.structure(other) != treedef  # batch_size is static

    @jax.jit
    @chex.assert_max_traces(n=1)
    def total(batch):
        return jnp.sum(batch.input_ids) + batch.tbo_split_seq_index

    assert int(total(b)) == int(b.input_ids.sum()) + 1
    assert int(total(b2)) == int(b2.input_ids.sum()) + 0


def _bad(**changes):
    base = dict(
        forward_mode=ForwardMode.EXTEND,
        batch_size=2,
        input_ids=np.arange(5),
        positions=np.arange(5),
        seq_lens=[2, 4],
        extend_seq_lens=[2, 3],
        extend_prefix_lens=[0, 1],
    )
    base.update(changes)
    return lambda: ForwardBatch(**base)


@pytest.mark.parametrize(
    "make, match",
    [
        (_bad(input_ids=np.arange(6), positions=np.arange(6)), r"sum\(extend_seq_lens\)=5 != 6"),
        (_bad(positions=np.arange(4)), r"positions has 4 rows, expected 5"),
        (_bad(out_cache_loc=np.arange(7)), r"out_cache_loc has 7 rows, expected 5"),
        (_bad(req_pool_indices=[1, 2, 3]), r"req_pool_indices has 3 rows, expected 2"),
        (_bad(extend_seq_lens=[6, -1]), r"extend_seq_lens has a negative length: min -1"),
        (_bad(extend_prefix_lens=[0, -2], seq_lens=[2, 1]), "negative"),
        (_bad(seq_lens=[2, 5]), r"seq_lens\[1\]=5 != extend_prefix_lens\[1\] \+"),
        (_bad(tbo_split_seq_index=3), r"tbo_split_seq_index=3 outside \[0, batch_size=2\]"),
        (_bad(tbo_split_seq_index=-1), r"tbo_split_seq_index=-1"),
        (_bad(extend_start_loc=[0, 1]), "extend_start_loc"),
        (_bad(extend_num_tokens=4), r"extend_num_tokens=4 != len\(input_ids\)=5"),
        (_bad(num_token_non_padded=9), r"num_token_non_padded=9"),
        (_bad(input_ids=None), "input_ids is required"),
        (
            _bad(batch_size=-1, seq_lens=None, extend_seq_lens=None, extend_prefix_lens=None),
            "batch_size",
        ),
        (_bad(tbo_parent_token_range=(3, 1)), "tbo_parent_token_range"),
        (_bad(global_num_tokens=[[1, 2]]), "global_num_tokens"),
        (
            _bad(forward_mode=ForwardMode.DECODE, extend_seq_lens=None, extend_prefix_lens=None),
            r"DECODE needs len\(input_ids\) == batch_size, got 5 != 2",
        ),
        (_bad(forward_mode=ForwardMode.TARGET_VERIFY), "TARGET_VERIFY needs spec_info"),
        (_bad(forward_mode=ForwardMode.IDLE), "IDLE has no real tokens"),
    ],
)
def test_bad_batches(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_spec_info():
    good = batches.verify_batch([3, 1, 4], 2)
    spec = good.spec_info
    short_mask = dataclasses.replace(spec, custom_mask=spec.custom_mask[:-1])
    with pytest.raises(ValueError, match=r"custom_mask has 27 entries, expected sum.* = 28"):
        dataclasses.replace(good, spec_info=short_mask)
    with pytest.raises(ValueError, match=r"spec_info.draft_token has 5 rows, expected 6"):
        dataclasses.replace(good, spec_info=dataclasses.replace(spec, draft_token=np.arange(5)))
    with pytest.raises(ValueError, match=r"spec_info.retrieve_index has 2 rows, expected 3"):
        dataclasses.replace(
            good, spec_info=dataclasses.replace(spec, retrieve_index=spec.retrieve_index[:2])
        )
    with pytest.raises(ValueError, match=r"seq_lens == spec_info.seq_lens, got \[3, 1, 5\]"):
        dataclasses.replace(good, seq_lens=np.array([3, 1, 5]))
    with pytest.raises(ValueError, match=r"batch_size \* draft_token_num, got 6 != 3 \* 3"):
        dataclasses.replace(
            good,
            spec_info=SpecVerifyInput(draft_token_num=3),
        )


def test_parent_is_not_mutated_by_replace():
    b = batches.extend_batch([2, 2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.batch_size = 3  # type: ignore[misc]
