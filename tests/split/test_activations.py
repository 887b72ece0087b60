"""In-graph split_inputs / merge_outputs against numpy, one trace across split indices, and the
child-capacity bound (and the capacities between the even split and it) against the planner."""

import math

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jtbo.split import (
    ForwardMode,
    child_capacities,
    child_capacity,
    compute_split_seq_index,
    compute_split_token_index,
    merge_outputs,
    plan_fits_capacity,
    split_inputs,
    take_merged_rows,
)

ROWS, CAP = 16, 10


def reference_split(x, t, n, cap):
    a = np.zeros((cap, *x.shape[1:]), x.dtype)
    b = np.zeros_like(a)
    a[:t] = x[:t]
    b[: n - t] = x[t:n]
    return a, b


def random_tree(seed):
    rng = np.random.default_rng(seed)
    return {
        "hidden_states": rng.standard_normal((ROWS, 3, 2)).astype(np.float32),
        "positions": rng.integers(1, 1000, ROWS).astype(np.int32),
    }


class SplitMergeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_split_and_merge_match_numpy(self):
        split = self.variant(lambda x, t, n: split_inputs(x, t, n, child_capacity=CAP, impl="xla"))
        merge = self.variant(lambda a, b, t, n: merge_outputs(a, b, t, n, out_len=ROWS, impl="xla"))
        for seed, (t, n) in enumerate([(0, 0), (3, 9), (8, 16), (6, 16), (10, 12), (0, 10)]):
            x = random_tree(seed)
            a, b = split(x, jnp.int32(t), jnp.int32(n))
            for key, leaf in x.items():
                ref_a, ref_b = reference_split(leaf, t, n, CAP)
                chex.assert_trees_all_equal((a[key], b[key]), (ref_a, ref_b))
            merged = merge(a, b, jnp.int32(t), jnp.int32(n))
            chex.assert_trees_all_equal(merged, rows_below(x, n))


def rows_below(tree, n):
    """Leaves with every row at or past ``n`` zeroed (what a merge of [0, n) gives)."""
    return jax.tree.map(lambda v: np.where(np.arange(ROWS) < n, v.T, 0).T, tree)


def test_one_trace_across_split_indices():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def roundtrip(x, t, n):
        a, b = split_inputs(x, t, n, child_capacity=CAP)
        a = jax.tree.map(lambda v: v * 2, a)  # some per-micro-batch compute
        b = jax.tree.map(lambda v: v * 2, b)
        return merge_outputs(a, b, t, n, out_len=ROWS)

    for t, n in [(4, 8), (6, 16), (8, 16), (0, 0)]:
        out = roundtrip(random_tree(t), jnp.int32(t), jnp.int32(n))
        assert out["positions"].shape == (ROWS,)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 1000))
def test_merge_of_split_is_identity(data, seed):
    n = data.draw(st.integers(0, ROWS))
    t = data.draw(st.integers(max(0, n - CAP), min(n, CAP)))
    x = random_tree(seed)
    a, b = _split_jit(x, jnp.int32(t), jnp.int32(n))
    merged = _merge_jit(a, b, jnp.int32(t), jnp.int32(n))
    chex.assert_trees_all_equal(merged, rows_below(x, n))


_split_jit = jax.jit(lambda x, t, n: split_inputs(x, t, n, child_capacity=CAP))
_merge_jit = jax.jit(lambda a, b, t, n: merge_outputs(a, b, t, n, out_len=ROWS))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), seed=st.integers(0, 1000))
def test_take_merged_rows_is_rows_of_the_merge(data, seed):
    n = data.draw(st.integers(1, ROWS))
    t = data.draw(st.integers(max(0, n - CAP), min(n, CAP)))
    rows = np.asarray(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6)), np.int32)
    x = random_tree(seed)
    a, b = _split_jit(x, jnp.int32(t), jnp.int32(n))
    got = _take_jit(a, b, jnp.int32(t), jnp.asarray(rows))
    chex.assert_trees_all_equal(got, jax.tree.map(lambda v: v[rows], x))


_take_jit = jax.jit(take_merged_rows)


def test_bad_trees():
    with pytest.raises(ValueError, match="same leading token axis"):
        split_inputs({"a": jnp.zeros(4), "b": jnp.zeros(5)}, 1, 3, child_capacity=4)
    with pytest.raises(ValueError, match="no array leaves"):
        split_inputs({}, 1, 3, child_capacity=4)
    with pytest.raises(ValueError, match="differ in structure"):
        merge_outputs({"a": jnp.zeros(4)}, {"b": jnp.zeros(4)}, 1, 3, out_len=4)
    with pytest.raises(ValueError, match="differ in structure"):
        take_merged_rows({"a": jnp.zeros(4)}, {"b": jnp.zeros(4)}, 1, jnp.zeros(2, jnp.int32))


def test_child_capacity_values():
    assert child_capacity(100) == 52
    assert child_capacity(100, threshold=0.0) == 100  # a single 100-token prompt stays whole
    assert child_capacity(7, threshold=0.5) == 4  # two-chunk: ceil(7 / 2)
    assert child_capacity(12, token_num_per_seq=4) == 8  # 3 verify seqs: B gets 2 * 4
    assert child_capacity(128) == 66  # a balanced EXTEND split may leave 66 on one side
    assert child_capacity(128, decode_like=True) == 64
    assert child_capacity(12, token_num_per_seq=4, decode_like=True) == 8
    assert child_capacity(7, decode_like=True, attn_tp_size=4) == 4
    assert child_capacity(100, attn_tp_size=8) == 56
    assert child_capacity(0) == 0
    with pytest.raises(ValueError, match="threshold"):
        child_capacity(10, threshold=0.7)
    with pytest.raises(ValueError, match="attn_tp_size=0"):
        child_capacity(10, attn_tp_size=0)
    assert plan_fits_capacity(5, 10, child_capacity=5)
    assert not plan_fits_capacity(4, 10, child_capacity=5)
    with pytest.raises(ValueError, match="split_token_index=11"):
        plan_fits_capacity(11, 10, child_capacity=5)


@settings(max_examples=150, deadline=None)
@given(
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=12),
    slack=st.integers(0, 40),
    threshold=st.sampled_from([0.0, 0.2, 0.4, 0.48, 0.5]),
    tp=st.sampled_from([1, 2, 4]),
)
def test_extend_plans_fit_child_capacity(lens, slack, threshold, tp):
    n = sum(lens)
    mode = ForwardMode.EXTEND
    s = compute_split_seq_index(mode, n, lens, None, threshold=threshold)
    t = compute_split_token_index(s, mode, lens, None, threshold=threshold)
    cap = child_capacity(n + slack, threshold=threshold, attn_tp_size=tp)
    assert cap % tp == 0
    assert plan_fits_capacity(t, n, child_capacity=cap)


@settings(max_examples=60, deadline=None)
@given(bs=st.integers(0, 40), per_seq=st.integers(1, 5), slack=st.integers(0, 9))
def test_decode_like_plans_fit_child_capacity(bs, per_seq, slack):
    mode = ForwardMode.DECODE if per_seq == 1 else ForwardMode.TARGET_VERIFY
    n = bs * per_seq
    s = compute_split_seq_index(mode, n, None, per_seq)
    t = compute_split_token_index(s, mode, None, per_seq)
    cap = child_capacity(n + slack, token_num_per_seq=per_seq)
    assert plan_fits_capacity(t, n, child_capacity=cap)
    assert cap <= math.ceil((n + slack) / 2) + per_seq
    tight = child_capacity(n + slack, token_num_per_seq=per_seq, decode_like=True)
    assert plan_fits_capacity(t, n, child_capacity=tight)
    assert tight <= cap


def test_child_capacities_values():
    # 4096 tokens at the default threshold: the even split's 2048, the bound 2129.
    assert child_capacities(4096) == (2048, 2129)
    assert child_capacities(4096, count=4) == (2048, 2075, 2102, 2129)
    assert child_capacities(4096, count=1) == (2129,)
    assert child_capacities(4096, count=4, attn_tp_size=64) == (2048, 2112, 2176)
    assert child_capacities(128, decode_like=True, count=3) == (64,)
    assert child_capacities(7, threshold=0.5) == (4,)  # the bound is the even split
    assert child_capacities(0) == (0,)
    with pytest.raises(ValueError, match="count=0"):
        child_capacities(16, count=0)


@settings(max_examples=150, deadline=None)
@given(
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=12),
    slack=st.integers(0, 40),
    threshold=st.sampled_from([0.0, 0.2, 0.48, 0.5]),
    tp=st.sampled_from([1, 2, 4]),
    count=st.integers(1, 5),
)
def test_child_capacities_hold_the_even_split_first_and_every_split_last(
    lens, slack, threshold, tp, count
):
    # Increasing multiples of tp ending at the bound; the smallest holds a parent's even
    # split (both halves at most ceil(C / 2)); the bound holds every planned split.
    n = sum(lens)
    capacity = n + slack
    caps = child_capacities(capacity, count=count, threshold=threshold, attn_tp_size=tp)
    assert list(caps) == sorted(set(caps)) and len(caps) <= count
    assert caps[-1] == child_capacity(capacity, threshold=threshold, attn_tp_size=tp)
    assert all(cap % tp == 0 for cap in caps)
    assert plan_fits_capacity(capacity // 2, capacity, child_capacity=caps[0])
    mode = ForwardMode.EXTEND
    s = compute_split_seq_index(mode, n, lens, None, threshold=threshold)
    t = compute_split_token_index(s, mode, lens, None, threshold=threshold)
    assert plan_fits_capacity(t, n, child_capacity=caps[-1])
