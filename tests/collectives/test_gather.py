"""The DP gather against a numpy reference, all layouts, both padding modes."""

import chex
import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.collectives import context as context_lib
from jtbo.collectives import gather, padding
from tests.collectives import harness

CAPACITY = 8
HIDDEN = 3
MODES = (padding.DpPaddingMode.MAX_LEN, padding.DpPaddingMode.SUM_LEN)


def reference_rank_values(local, dp_size, attn_tp_size, counts):
    """[dp, C, H] each DP rank's rows (its first attn_tp device's), zero past its count."""
    local = local.reshape(dp_size, attn_tp_size, CAPACITY, -1).astype(np.float64)
    values = local[:, 0]
    values[np.arange(CAPACITY)[None, :] >= np.asarray(counts)[:, None]] = 0
    return values


def reference_gather(values, counts, mode, global_len):
    if mode.is_max_len():
        return values.reshape(-1, values.shape[-1])
    out = np.zeros((global_len, values.shape[-1]))
    start = 0
    for rank, count in enumerate(counts):
        out[start : start + count] = values[rank, :count]
        start += count
    return out


def count_cases(dp_size, rng):
    """Uneven counts with an idle rank and one rank exactly at capacity."""
    random = rng.integers(0, CAPACITY + 1, dp_size)
    random[0] = CAPACITY
    if dp_size > 1:
        random[-1] = 0
    return [random.tolist(), [CAPACITY - 1] * dp_size]


def make_replicated(dp_size, attn_tp_size, rng):
    """``[devices * C, H]`` random rows, the same on every attn_tp device of a DP rank."""
    per_rank = rng.standard_normal((dp_size, 1, CAPACITY, HIDDEN)).astype(np.float32)
    replicated = np.broadcast_to(per_rank, (dp_size, attn_tp_size, CAPACITY, HIDDEN))
    return np.ascontiguousarray(replicated).reshape(-1, HIDDEN)


def _gather(context, local):
    return (gather.dp_gather_replicate(local, context, memcpy_impl="xla"),)


def _check(got, local, dp_size, attn_tp_size, counts, mode, global_len, devices=None):
    values = reference_rank_values(local, dp_size, attn_tp_size, counts)
    want = reference_gather(values, counts, mode, global_len)
    outs = harness.per_device(got, dp_size * attn_tp_size)
    for device_out in outs if devices is None else outs[devices]:
        chex.assert_trees_all_close(device_out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dp_size, attn_tp_size", harness.LAYOUTS)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_dp_gather_matches_numpy(dp_size, attn_tp_size, mode):
    rng = np.random.default_rng(dp_size * 10 + int(mode))
    local = make_replicated(dp_size, attn_tp_size, rng)
    run = harness.sharded(_gather, dp_size, attn_tp_size, 1, 1)
    for counts in count_cases(dp_size, rng):
        global_len = dp_size * CAPACITY  # a fixed bucket: counts change, shapes do not
        context = context_lib.create_dp_context(
            counts, mode, CAPACITY, attn_tp_size, global_buffer_len=global_len
        )
        (got,) = run(context, local)
        _check(got, local, dp_size, attn_tp_size, counts, mode, global_len)


@pytest.mark.parametrize("dp_size, attn_tp_size", ((4, 2), (8, 1)))
def test_sum_len_exact_buffer(dp_size, attn_tp_size):
    """SUM_LEN with the buffer exactly the token sum: the last rank's copy ends at its last row."""
    rng = np.random.default_rng(7)
    local = make_replicated(dp_size, attn_tp_size, rng)
    counts = count_cases(dp_size, rng)[0]
    counts[-1] = CAPACITY  # the last rank is full: its slot would overrun a clamped copy
    mode = padding.DpPaddingMode.SUM_LEN
    context = context_lib.create_dp_context(counts, mode, CAPACITY, attn_tp_size, sum(counts))
    (got,) = harness.sharded(_gather, dp_size, attn_tp_size, 1, 1)(context, local)
    _check(got, local, dp_size, attn_tp_size, counts, mode, sum(counts))


def test_local_rows_must_match_capacity():
    context = context_lib.create_dp_context([1, 2], padding.DpPaddingMode.MAX_LEN, CAPACITY)
    bad = np.zeros((2 * (CAPACITY + 1), 1), np.float32)
    with pytest.raises(ValueError, match="local_capacity=8"):
        harness.sharded(_gather, 2, 1, 1, 1)(context, bad)


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(
    counts=st.lists(st.integers(0, CAPACITY), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_sum_len_any_counts_one_compile(counts, seed):
    """Random counts through one compiled SUM_LEN step (counts are traced, shapes fixed)."""
    local = make_replicated(4, 2, np.random.default_rng(seed))
    mode = padding.DpPaddingMode.SUM_LEN
    context = context_lib.create_dp_context(
        counts, mode, CAPACITY, 2, global_buffer_len=4 * CAPACITY
    )
    (got,) = harness.sharded(_gather, 4, 2, 1, 1)(context, local)
    _check(got, local, 4, 2, counts, mode, 4 * CAPACITY, devices=slice(3, 4))


@pytest.mark.parametrize("dp_size, attn_tp_size", ((4, 2), (8, 1)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sum_len_replicate_gather_moves_the_bits(dp_size, attn_tp_size, dtype):
    """The MoE backend "none" gathers rows with expert ids bitcast into them: -0.0 and the
    denormal patterns of small ids must cross a SUM_LEN gather unchanged (a float all-reduce
    turns -0.0 into 0.0 and may flush denormals)."""
    rng = np.random.default_rng(11)
    itemsize = jnp.dtype(dtype).itemsize
    per_rank = rng.integers(0, 256, (dp_size, 1, CAPACITY, HIDDEN * itemsize)).astype(np.uint8)
    per_rank[..., :itemsize] = 0
    per_rank[..., itemsize - 1] = 0x80  # -0.0 in the first column of every row
    per_rank[..., itemsize : 2 * itemsize] = 0  # a denormal (id 3) in the second column
    per_rank[..., itemsize] = 3
    raw = np.broadcast_to(per_rank, (dp_size, attn_tp_size, CAPACITY, HIDDEN * itemsize))
    local = np.frombuffer(np.ascontiguousarray(raw).tobytes(), dtype).reshape(-1, HIDDEN)
    counts = count_cases(dp_size, rng)[0]
    sums = {}
    for mode in MODES:
        context = context_lib.create_dp_context(counts, mode, CAPACITY, attn_tp_size)
        (got,) = harness.sharded(_gather, dp_size, attn_tp_size, 1, 1)(context, local)
        sums[mode] = harness.per_device(got, dp_size * attn_tp_size)
    values = np.asarray(local).reshape(dp_size, attn_tp_size, CAPACITY, HIDDEN)[:, 0]
    want = np.concatenate([values[r, :n] for r, n in enumerate(counts)])
    for device_out in sums[padding.DpPaddingMode.SUM_LEN]:
        assert device_out.shape[0] >= sum(counts)
        np.testing.assert_array_equal(device_out[: sum(counts)].view(np.uint8), want.view(np.uint8))
        assert not np.asarray(device_out[sum(counts) :]).view(np.uint8).any()
    slots = sums[padding.DpPaddingMode.MAX_LEN][0].reshape(dp_size, CAPACITY, HIDDEN)
    max_rows = np.concatenate([slots[r, :n] for r, n in enumerate(counts)])
    np.testing.assert_array_equal(max_rows.view(np.uint8), want.view(np.uint8))
