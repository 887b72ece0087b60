"""Capacity-slot experts vs the exact ragged_dot reference vs a float64 numpy loop."""

import chex
import jax
import numpy as np
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.models import config as config_lib
from jtbo.models import experts

# float32 matmuls run in TF32 on NVIDIA GPUs (XLA's default precision): about 1e-3 relative
# there (a GPU run of this file saw ragged_dot off by more than 1e-4), float32 rounding on
# the CPU.
F32_TOL = (
    dict(atol=1e-4, rtol=1e-4) if jax.default_backend() == "cpu" else dict(atol=3e-3, rtol=3e-3)
)


def _numpy_experts(x, ids, w, weights):
    w_gate_up, wd = (np.asarray(a, np.float64) for a in weights)
    wg, wu = w_gate_up[:, :, 0], w_gate_up[:, :, 1]
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            if not 0 <= e < wg.shape[0]:
                continue
            g = x[t] @ wg[e]
            out[t] += w[t, j] * ((g / (1 + np.exp(-g)) * (x[t] @ wu[e])) @ wd[e])
    return out


def _inputs(seed, num_tokens):
    cfg = config_lib.MoEConfig.tiny()
    module = experts.RoutedExperts(cfg, rngs=nnx.Rngs(seed))
    r = np.random.default_rng(seed)
    x = r.normal(size=(num_tokens, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([r.permutation(cfg.num_experts)[:2] for _ in range(num_tokens)])
    w = r.random((num_tokens, 2)).astype(np.float32)
    return module.weights, x, ids.astype(np.int32), w


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 1000), num_tokens=st.integers(1, 12))
def test_capacity_and_ragged_match_numpy(seed, num_tokens):
    weights, x, ids, w = _inputs(seed, num_tokens)
    want = _numpy_experts(x, ids, w, weights)
    capacity = experts.experts_capacity(x, ids, w, weights)
    ragged = experts.experts_ragged_dot_reference(x, ids, w, weights)
    chex.assert_trees_all_close(capacity, want, **F32_TOL)
    chex.assert_trees_all_close(ragged, want, **F32_TOL)


def test_padding_ids_take_no_slot_and_small_capacity_drops():
    weights, x, ids, w = _inputs(7, 9)
    ids[3] = -1
    want = _numpy_experts(x, ids, w, weights)
    chex.assert_trees_all_close(
        experts.experts_capacity(x, ids, w, weights), want, rtol=1e-4, atol=1e-4
    )
    ids[:] = np.array([0, 1])  # every token picks experts 0 and 1: capacity 4 keeps tokens 0..3
    dropped = experts.experts_capacity(x, ids, w, weights, capacity=4)
    kept = _numpy_experts(x[:4], ids[:4], w[:4], weights)
    chex.assert_trees_all_close(dropped[:4], kept, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(dropped[4:]), 0.0)


def test_pallas_slot_ffn_with_padding_and_dropped_pairs_matches_numpy():
    # The grouped GEMM kernel (Pallas interpreter on the CPU) behind experts_capacity: a
    # padding pair, then a capacity that drops pairs (expert 0 and 1 keep 4 rows each).
    weights, x, ids, w = _inputs(5, 9)
    ids[3] = -1
    got = experts.experts_capacity(x, ids, w, weights, impl="pallas")
    chex.assert_trees_all_close(got, _numpy_experts(x, ids, w, weights), rtol=1e-4, atol=1e-4)
    ids[:] = np.array([0, 1])
    dropped = experts.experts_capacity(x, ids, w, weights, capacity=4, impl="pallas")
    kept = _numpy_experts(x[:4], ids[:4], w[:4], weights)
    chex.assert_trees_all_close(dropped[:4], kept, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(dropped[4:]), 0.0)


def test_slot_positions_count_earlier_pairs():
    ids = jax.numpy.array([[0, 2], [2, 1], [0, 2]])
    np.testing.assert_array_equal(experts.slot_positions(ids, 3), [[0, 0], [1, 0], [1, 2]])


def _grouped_dot_by_row(lhs, rhs, group_sizes, out_dtype):
    """A grouped GEMM without ragged_dot: each row takes its group's matrix."""
    group = np.searchsorted(np.cumsum(np.asarray(group_sizes)), np.arange(lhs.shape[0]), "right")
    out = jax.numpy.einsum("mk,mkn->mn", lhs, rhs[group], preferred_element_type=out_dtype)
    return out.astype(out_dtype)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 1000), num_tokens=st.integers(1, 12))
def test_sorted_layout_with_any_grouped_gemm_matches_numpy(seed, num_tokens):
    weights, x, ids, w = _inputs(seed, num_tokens)
    got = experts.experts_sorted(x, ids, w, weights, _grouped_dot_by_row)
    chex.assert_trees_all_close(got, _numpy_experts(x, ids, w, weights), rtol=1e-4, atol=1e-4)
