"""RMSNorm, RoPE, SwiGLU and dense attention against float64 numpy."""

import chex
import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.models import mlp, norm, rope, self_attention


def _rng(seed):
    return np.random.default_rng(seed)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 1000), dim=st.sampled_from([4, 16]))
def test_rms_norm_matches_numpy(seed, dim):
    x = _rng(seed).normal(size=(5, dim)).astype(np.float32)
    w = _rng(seed + 1).normal(size=(dim,)).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-6) * w
    chex.assert_trees_all_close(norm.rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-5)


def _rope_numpy(x, positions, theta):
    d = x.shape[-1]
    out = np.empty_like(x, dtype=np.float64)
    for t, p in enumerate(positions):
        for i in range(d // 2):
            angle = p * theta ** (-2.0 * i / d)
            a, b = x[t, :, i], x[t, :, i + d // 2]
            out[t, :, i] = a * np.cos(angle) - b * np.sin(angle)
            out[t, :, i + d // 2] = b * np.cos(angle) + a * np.sin(angle)
    return out


def test_rope_matches_numpy_and_preserves_relative_dot():
    x = _rng(0).normal(size=(6, 3, 8)).astype(np.float32)
    positions = np.array([0, 1, 5, 9, 30, 2])
    got = rope.apply_rope(x, positions, 10000.0)
    chex.assert_trees_all_close(got, _rope_numpy(x, positions, 10000.0), rtol=1e-4, atol=1e-4)
    # Rotations make q.k depend only on the position difference.
    q, k = x[0:1], x[1:2]
    dot_a = np.sum(
        np.asarray(rope.apply_rope(q, np.array([3]), 1e4) * rope.apply_rope(k, np.array([1]), 1e4))
    )
    dot_b = np.sum(
        np.asarray(
            rope.apply_rope(q, np.array([12]), 1e4) * rope.apply_rope(k, np.array([10]), 1e4)
        )
    )
    np.testing.assert_allclose(dot_a, dot_b, rtol=1e-4)


def test_swiglu_matches_numpy():
    r = _rng(3)
    x, wg, wu, wd = (r.normal(size=s).astype(np.float32) for s in [(4, 8), (8, 6), (8, 6), (6, 8)])
    g = x.astype(np.float64) @ wg
    want = (g / (1 + np.exp(-g)) * (x.astype(np.float64) @ wu)) @ wd
    got = mlp.swiglu(x, np.stack([wg, wu], axis=1), wd)  # w_gate_up [H, 2, F]
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_dense_attention_matches_numpy_gqa_and_empty_rows():
    r = _rng(4)
    q = r.normal(size=(3, 4, 8)).astype(np.float32)
    k = r.normal(size=(5, 2, 8)).astype(np.float32)
    v = r.normal(size=(5, 2, 8)).astype(np.float32)
    mask = r.random((3, 5)) < 0.6
    mask[0] = False  # a padding row: no key allowed -> zeros
    mask[1, 0] = True
    got = np.asarray(self_attention.dense_attention(q, k, v, mask))
    for h in range(4):
        s = q[:, h].astype(np.float64) @ k[:, h // 2].T.astype(np.float64) / np.sqrt(8)
        for i in range(3):
            if not mask[i].any():
                np.testing.assert_array_equal(got[i, h], 0.0)
                continue
            p = np.where(mask[i], np.exp(s[i] - s[i][mask[i]].max()), 0.0)
            want = (p / p.sum()) @ v[:, h // 2]
            np.testing.assert_allclose(got[i, h], want, rtol=1e-4, atol=1e-5)
    assert jax.numpy.isfinite(got).all()
