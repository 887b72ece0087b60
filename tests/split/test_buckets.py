"""pad_batch and token buckets: static-capacity batches serve many steps with one trace."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.split import default_token_buckets, pad_batch, split_batch, token_bucket
from tests.split import batches
from tests.split.test_children import planned


def test_buckets():
    assert default_token_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert default_token_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_token_buckets(1) == (1,)
    assert token_bucket(0, (4, 8)) == 4
    assert token_bucket(5, (4, 8)) == 8
    assert token_bucket(8, (4, 8)) == 8
    for args, match in [
        ((9, (4, 8)), "exceeds the largest bucket 8"),
        ((3, (8, 4)), "strictly increasing"),
        ((3, ()), "strictly increasing"),
        ((-1, (4,)), "num_tokens"),
        ((1, (0, 4)), "positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            token_bucket(*args)
    with pytest.raises(ValueError, match="max_tokens"):
        default_token_buckets(0)


def test_pad_extend_keeps_real_rows_and_counts():
    b = batches.extend_batch([3, 5], tbo_split_seq_index=1)
    p = pad_batch(b, token_capacity=16, seq_capacity=4)
    assert (p.num_tokens, p.batch_size, p.num_token_non_padded) == (16, 4, 8)
    assert p.extend_num_tokens == 16 and p.tbo_split_seq_index == 1
    np.testing.assert_array_equal(p.input_ids[:8], b.input_ids)
    np.testing.assert_array_equal(p.input_ids[8:], 0)
    np.testing.assert_array_equal(p.extend_seq_lens, [3, 5, 0, 0])
    np.testing.assert_array_equal(p.extend_start_loc, [0, 3, 8, 8])
    np.testing.assert_array_equal(p.seq_lens[2:], 0)


def test_pad_child_and_verify():
    a, _ = split_batch(planned(batches.extend_batch([30, 3])), attn_tp_size=2)
    p = pad_batch(a, token_capacity=32, seq_capacity=2)
    assert p.tbo_padded_len == 32 and p.tbo_parent_token_range == a.tbo_parent_token_range
    v = batches.verify_batch([3, 1], 2)
    pv = pad_batch(v, token_capacity=8, seq_capacity=4, mask_capacity=64)
    assert pv.spec_info.custom_mask.shape == (64,) and pv.num_token_non_padded == 4
    np.testing.assert_array_equal(pv.spec_info.custom_mask[:16], v.spec_info.custom_mask)


@pytest.mark.parametrize(
    "make, kw, match",
    [
        (lambda: batches.extend_batch([3, 5]), dict(token_capacity=7, seq_capacity=2), "< len"),
        (lambda: batches.extend_batch([3, 5]), dict(token_capacity=8, seq_capacity=1), "< batch"),
        (lambda: batches.decode_batch(3), dict(token_capacity=8, seq_capacity=4), "8 != 4 \\* 1"),
        (
            lambda: batches.verify_batch([3, 1], 2),
            dict(token_capacity=8, seq_capacity=4, mask_capacity=20),
            "mask_capacity >= 24",
        ),
    ],
)
def test_pad_bad_capacities(make, kw, match):
    with pytest.raises(ValueError, match=match):
        pad_batch(make(), **kw)


def test_one_trace_per_bucket():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def real_token_sum(batch):
        rows = jnp.arange(batch.input_ids.shape[0])
        return jnp.sum(jnp.where(rows < batch.num_token_non_padded, batch.input_ids, 0))

    for seed, lens in enumerate([[3, 5], [1, 1, 9], [16], [2, 2, 2, 2]]):
        b = planned(batches.extend_batch(lens, seed=seed))
        p = pad_batch(b, token_capacity=token_bucket(b.num_tokens, (8, 16)), seq_capacity=4)
        if p.num_tokens == 16:
            assert int(real_token_sum(p)) == int(b.input_ids.sum())
