"""Router top-k rules against a per-token numpy implementation."""

import dataclasses

import chex
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.models import config as config_lib
from jtbo.models import router


def _grouped_numpy(logits, bias, cfg):
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    per = cfg.num_experts // cfg.n_group
    ids, weights = [], []
    for s in scores:
        biased = s + bias
        rating = [np.sort(biased[g * per : (g + 1) * per])[-2:].sum() for g in range(cfg.n_group)]
        groups = np.argsort(-np.asarray(rating), kind="stable")[: cfg.topk_group]
        eligible = np.full_like(biased, -np.inf)
        for g in groups:
            eligible[g * per : (g + 1) * per] = biased[g * per : (g + 1) * per]
        chosen = np.argsort(-eligible, kind="stable")[: cfg.num_experts_per_tok]
        w = s[chosen]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        ids.append(chosen)
        weights.append(w * cfg.routed_scaling_factor)
    return np.array(weights), np.array(ids)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.sampled_from([1.0, 2.5]), norm=st.booleans())
def test_grouped_topk_matches_numpy(seed, scale, norm):
    cfg = dataclasses.replace(
        config_lib.MoEConfig.tiny(),
        num_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        routed_scaling_factor=scale,
        norm_topk_prob=norm,
    )
    r = np.random.default_rng(seed)
    logits = r.normal(size=(7, 16)).astype(np.float32)
    bias = r.normal(size=(16,)).astype(np.float32) * 0.5
    weights, ids = router.select_experts(logits, bias, cfg)
    want_w, want_ids = _grouped_numpy(logits, bias.astype(np.float64), cfg)
    np.testing.assert_array_equal(np.sort(ids, 1), np.sort(want_ids, 1))
    order = np.argsort(np.asarray(ids), 1)
    want_order = np.argsort(want_ids, 1)
    got_sorted = np.take_along_axis(np.asarray(weights), order, 1)
    chex.assert_trees_all_close(
        got_sorted, np.take_along_axis(want_w, want_order, 1), rtol=1e-5, atol=1e-6
    )


def test_bias_changes_choice_not_weight():
    cfg = config_lib.MoEConfig.tiny()
    logits = np.zeros((1, 8), np.float32)
    logits[0, :] = np.linspace(-1, 1, 8)
    bias = np.zeros(8, np.float32)
    bias[0] = 10.0  # the worst expert becomes eligible first
    weights, ids = router.select_experts(
        logits, bias, dataclasses.replace(cfg, norm_topk_prob=False)
    )
    assert 0 in np.asarray(ids)[0]
    sig = 1 / (1 + np.exp(-logits[0]))
    np.testing.assert_allclose(np.sort(weights[0]), np.sort(sig[np.asarray(ids)[0]]), rtol=1e-6)


def test_softmax_topk_matches_numpy():
    cfg = config_lib.MoEConfig.tiny_softmax()
    logits = np.random.default_rng(1).normal(size=(6, 8)).astype(np.float32)
    weights, ids = router.select_experts(logits, None, cfg)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p = p / p.sum(1, keepdims=True)
    want_ids = np.argsort(-p, 1)[:, :2]
    want = np.take_along_axis(p, want_ids, 1)
    np.testing.assert_array_equal(ids, want_ids)
    chex.assert_trees_all_close(weights, want / want.sum(1, keepdims=True), rtol=1e-5)
