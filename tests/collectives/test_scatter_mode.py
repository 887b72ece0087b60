"""Scatter-mode conversions of the (hidden_states, residual) pair against numpy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.collectives import context as context_lib
from jtbo.collectives import padding, scatter_mode
from tests.collectives import harness

SM = scatter_mode.ScatterMode
CAPACITY = 8
HIDDEN = 4


def rms_norm(x):
    # Row-wise and zero-preserving, like the model's RMSNorm without a weight.
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def rms_norm_np(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _to_full(context, hidden, residual):
    return scatter_mode.communicate_with_all_reduce_and_layernorm(
        hidden,
        residual,
        context,
        hidden_states_input_mode=SM.TP_ATTN_FULL,
        residual_input_mode=SM.TP_ATTN_FULL,
        hidden_states_output_mode=SM.FULL,
        residual_output_mode=SM.TP_ATTN_FULL,
        norm=rms_norm,
        memcpy_impl="xla",
    )


def _to_full_from_scattered_residual(context, hidden, residual):
    return scatter_mode.communicate_with_all_reduce_and_layernorm(
        hidden,
        residual,
        context,
        hidden_states_input_mode=SM.TP_ATTN_FULL,
        residual_input_mode=SM.SCATTERED,
        hidden_states_output_mode=SM.FULL,
        residual_output_mode=SM.TP_ATTN_FULL,
        norm=rms_norm,
        memcpy_impl="xla",
    )


def _to_scattered(context, hidden, residual):
    return scatter_mode.communicate_with_all_reduce_and_layernorm(
        hidden,
        residual,
        context,
        hidden_states_input_mode=SM.TP_ATTN_FULL,
        residual_input_mode=SM.TP_ATTN_FULL,
        hidden_states_output_mode=SM.SCATTERED,
        residual_output_mode=SM.SCATTERED,
        norm=rms_norm,
    )


def _postprocess_pairs(context, full_hidden, scattered_hidden, scattered_residual):
    from_full, _ = scatter_mode.communicate_summable_tensor_pair(
        full_hidden,
        None,
        context,
        hidden_states_input_mode=SM.FULL,
        residual_input_mode=SM.TP_ATTN_FULL,
        output_mode=SM.TP_ATTN_FULL,
        hidden_states_is_partial_sum=True,
        memcpy_impl="xla",
    )
    gathered, residual = scatter_mode.communicate_summable_tensor_pair(
        scattered_hidden,
        scattered_residual,
        context,
        hidden_states_input_mode=SM.SCATTERED,
        residual_input_mode=SM.SCATTERED,
        output_mode=SM.TP_ATTN_FULL,
    )
    if residual is not None:  # equal layouts (attn_tp == 1) keep the pair as it was
        gathered = gathered + residual
    rescattered, _ = scatter_mode.communicate_summable_tensor_pair(
        gathered,
        None,
        context,
        hidden_states_input_mode=SM.TP_ATTN_FULL,
        residual_input_mode=SM.TP_ATTN_FULL,
        output_mode=SM.SCATTERED,
    )
    simple = scatter_mode.communicate_simple(
        scattered_hidden, context, input_mode=SM.SCATTERED, output_mode=SM.TP_ATTN_FULL
    )
    return from_full, gathered, rescattered, simple


def layout_inputs(dp_size, attn_tp_size, rng):
    num_devices = dp_size * attn_tp_size
    counts = rng.integers(0, CAPACITY + 1, dp_size)
    counts[0] = CAPACITY
    counts[-1] = 0 if dp_size > 1 else 5
    hidden = rng.standard_normal((num_devices, CAPACITY, HIDDEN)).astype(np.float32)
    residual_rank = rng.standard_normal((dp_size, 1, CAPACITY, HIDDEN)).astype(np.float32)
    residual = np.broadcast_to(residual_rank, (dp_size, attn_tp_size, CAPACITY, HIDDEN))
    return counts.tolist(), hidden, np.ascontiguousarray(residual)


@pytest.mark.parametrize("dp_size, attn_tp_size", harness.LAYOUTS)
def test_to_full_same_in_both_padding_modes(dp_size, attn_tp_size):
    rng = np.random.default_rng(dp_size)
    counts, hidden, residual = layout_inputs(dp_size, attn_tp_size, rng)
    num_devices = dp_size * attn_tp_size
    # Reference: each DP rank's complete attention output plus residual, zero past its count.
    total = hidden.reshape(dp_size, attn_tp_size, CAPACITY, HIDDEN).astype(np.float64).sum(1)
    total = total + residual[:, 0]
    total[np.arange(CAPACITY)[None] >= np.asarray(counts)[:, None]] = 0
    valid_rows = [total[r, : counts[r]] for r in range(dp_size)]
    results = {}
    for mode in padding.DpPaddingMode:
        context = context_lib.create_dp_context(
            counts, mode, CAPACITY, attn_tp_size, global_buffer_len=dp_size * CAPACITY
        )
        fn = _to_full if mode.is_max_len() else _to_full_from_scattered_residual
        res_in = residual.reshape(-1, HIDDEN)
        if fn is _to_full_from_scattered_residual:
            # Each device holds its attn_tp block of the rank's residual (SCATTERED).
            res_in = residual.reshape(dp_size, attn_tp_size, attn_tp_size, -1, HIDDEN)
            res_in = res_in[:, 0].reshape(-1, HIDDEN)
        run = harness.sharded(fn, dp_size, attn_tp_size, 2, 2)
        mlp_in, res_out = run(context, hidden.reshape(-1, HIDDEN), res_in)
        mlp_in = harness.per_device(mlp_in, num_devices)
        res_out = harness.per_device(res_out, num_devices)
        for device in range(num_devices):
            rank = device // attn_tp_size
            chex.assert_trees_all_close(res_out[device], total[rank], rtol=1e-5, atol=1e-5)
        want = np.concatenate(valid_rows) if mode.is_sum_len() else total.reshape(-1, HIDDEN)
        want = rms_norm_np(want)
        for device_in in mlp_in:
            chex.assert_trees_all_close(device_in[: want.shape[0]], want, rtol=1e-4, atol=1e-5)
        results[mode] = res_out
    chex.assert_trees_all_close(*results.values(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dp_size, attn_tp_size", ((4, 2), (1, 8)))
def test_to_scattered(dp_size, attn_tp_size):
    rng = np.random.default_rng(11)
    counts, hidden, residual = layout_inputs(dp_size, attn_tp_size, rng)
    context = context_lib.create_dp_context(
        counts, padding.DpPaddingMode.MAX_LEN, CAPACITY, attn_tp_size
    )
    run = harness.sharded(_to_scattered, dp_size, attn_tp_size, 2, 2)
    mlp_in, res_out = run(context, hidden.reshape(-1, HIDDEN), residual.reshape(-1, HIDDEN))
    total = hidden.reshape(dp_size, attn_tp_size, CAPACITY, HIDDEN).astype(np.float64).sum(1)
    total = total + residual[:, 0]
    want_res = total.reshape(dp_size * attn_tp_size, CAPACITY // attn_tp_size, HIDDEN)
    got_res = harness.per_device(res_out, dp_size * attn_tp_size)
    chex.assert_trees_all_close(got_res, want_res, rtol=1e-5, atol=1e-5)
    got_in = harness.per_device(mlp_in, dp_size * attn_tp_size)
    chex.assert_trees_all_close(got_in, rms_norm_np(want_res), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dp_size, attn_tp_size", ((2, 4), (8, 1)))
def test_postprocess_conversions(dp_size, attn_tp_size):
    rng = np.random.default_rng(5)
    num_devices = dp_size * attn_tp_size
    counts = [CAPACITY] + [3] * (dp_size - 1)
    context = context_lib.create_dp_context(
        counts, padding.DpPaddingMode.MAX_LEN, CAPACITY, attn_tp_size
    )
    global_len = dp_size * CAPACITY
    full = rng.standard_normal((num_devices, global_len, HIDDEN)).astype(np.float32)
    shard_rows = CAPACITY // attn_tp_size
    scattered_h = rng.standard_normal((num_devices, shard_rows, HIDDEN)).astype(np.float32)
    scattered_r = rng.standard_normal((num_devices, shard_rows, HIDDEN)).astype(np.float32)
    run = harness.sharded(_postprocess_pairs, dp_size, attn_tp_size, 3, 4)
    outs = run(
        context,
        full.reshape(-1, HIDDEN),
        scattered_h.reshape(-1, HIDDEN),
        scattered_r.reshape(-1, HIDDEN),
    )
    from_full, gathered, rescattered, simple = (harness.per_device(o, num_devices) for o in outs)
    summed = full.astype(np.float64).sum(0)
    folded = (scattered_h + scattered_r).reshape(dp_size, CAPACITY, HIDDEN)
    plain = scattered_h.reshape(dp_size, CAPACITY, HIDDEN)
    for device in range(num_devices):
        rank = device // attn_tp_size
        want = summed[rank * CAPACITY : (rank + 1) * CAPACITY].copy()
        want[counts[rank] :] = 0
        chex.assert_trees_all_close(from_full[device], want, rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(gathered[device], folded[rank], rtol=1e-6)
        chex.assert_trees_all_close(simple[device], plain[rank])
    chex.assert_trees_all_close(rescattered, scattered_h + scattered_r, rtol=1e-6)


def _bad_simple(context, hidden):
    return (
        scatter_mode.communicate_simple(
            hidden, context, input_mode=SM.FULL, output_mode=SM.SCATTERED
        ),
    )


def test_undefined_conversion_raises():
    context = context_lib.create_dp_context([1, 1], padding.DpPaddingMode.MAX_LEN, 4, 4)
    with pytest.raises(ValueError, match="FULL -> SCATTERED"):
        harness.sharded(_bad_simple, 2, 4, 1, 1)(context, np.zeros((8 * 8, 1), np.float32))


def test_modes_with_equal_groups_are_trivial():
    context = context_lib.create_dp_context([1, 1], padding.DpPaddingMode.MAX_LEN, 4)
    assert scatter_mode.is_same_layout(SM.SCATTERED, SM.TP_ATTN_FULL, context)
    assert not scatter_mode.is_same_layout(SM.TP_ATTN_FULL, SM.FULL, context)
    assert SM.model_input_output() is SM.TP_ATTN_FULL
