"""dp_scatter and dp_reduce_scatter_tensor against numpy, all layouts, both padding modes."""

import chex
import numpy as np
import pytest

from jtbo.collectives import context as context_lib
from jtbo.collectives import padding, scatter
from tests.collectives import harness

CAPACITY = 8
HIDDEN = 2


def _scatters(context, replicated_global, partial_global):
    return (
        scatter.dp_scatter(replicated_global, context, memcpy_impl="xla"),
        scatter.dp_reduce_scatter_tensor(partial_global, context, memcpy_impl="xla"),
    )


def rank_rows(global_rows, counts, mode, rank):
    """[C, H] rank's rows of a gathered buffer, zero past its count."""
    start = rank * CAPACITY if mode.is_max_len() else sum(counts[:rank])
    out = np.zeros((CAPACITY, global_rows.shape[-1]))
    out[: counts[rank]] = global_rows[start : start + counts[rank]]
    return out


@pytest.mark.parametrize("dp_size, attn_tp_size", harness.LAYOUTS)
@pytest.mark.parametrize("mode", padding.DpPaddingMode, ids=lambda m: m.name)
def test_scatters_match_numpy(dp_size, attn_tp_size, mode):
    rng = np.random.default_rng(dp_size + 3 * int(mode))
    num_devices = dp_size * attn_tp_size
    counts = rng.integers(0, CAPACITY + 1, dp_size)
    counts[0] = CAPACITY
    counts[-1] = 0 if dp_size > 1 else CAPACITY
    counts = counts.tolist()
    global_len = dp_size * CAPACITY
    context = context_lib.create_dp_context(counts, mode, CAPACITY, attn_tp_size, global_len)
    one_global = rng.standard_normal((global_len, HIDDEN)).astype(np.float32)
    replicated = np.tile(one_global, (num_devices, 1))
    partial = rng.standard_normal((num_devices * global_len, HIDDEN)).astype(np.float32)
    run = harness.sharded(_scatters, dp_size, attn_tp_size, 2, 2)
    got_scatter, got_reduce = run(context, replicated, partial)
    summed = harness.per_device(partial, num_devices).astype(np.float64).sum(0)
    got_scatter = harness.per_device(got_scatter, num_devices)
    got_reduce = harness.per_device(got_reduce, num_devices)
    for device in range(num_devices):
        rank = device // attn_tp_size
        want = rank_rows(one_global, counts, mode, rank)
        chex.assert_trees_all_close(got_scatter[device], want)
        want = rank_rows(summed, counts, mode, rank)
        chex.assert_trees_all_close(got_reduce[device], want, rtol=1e-5, atol=1e-5)


def test_global_rows_must_match_buffer():
    context = context_lib.create_dp_context([1, 2], padding.DpPaddingMode.MAX_LEN, CAPACITY)
    bad = np.zeros((2 * 5, 1), np.float32)
    with pytest.raises(ValueError, match="global_buffer_len=16"):
        harness.sharded(_scatters, 2, 1, 2, 2)(context, bad, bad)
