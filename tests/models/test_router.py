"""Router top-k rules against a per-token numpy implementation."""

import dataclasses

import chex
import numpy as np
import pytest
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


def _deepseek_numpy(logits, bias, cfg):
    """Per token, in float64: DeepSeek's scoring and topk_method spelled out."""
    x = logits.astype(np.float64)
    if cfg.scoring_func == "softmax":
        scores = np.exp(x - x.max(1, keepdims=True))
        scores = scores / scores.sum(1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-x))
    method, per = cfg.router_topk_method, cfg.num_experts // cfg.n_group
    ids, weights = [], []
    for s in scores:
        biased = s + bias
        groups = [biased[g * per : (g + 1) * per] for g in range(cfg.n_group)]
        if method == "greedy":
            kept = range(cfg.n_group)
        else:
            rate = (lambda g: g.max()) if method == "group_limited_greedy" else (
                lambda g: np.sort(g)[-2:].sum())  # fmt: skip
            kept = np.argsort([-rate(g) for g in groups], kind="stable")[: cfg.topk_group]
        eligible = np.full_like(biased, -np.inf)
        for g in kept:
            eligible[g * per : (g + 1) * per] = groups[g]
        chosen = np.sort(np.argsort(-eligible, kind="stable")[: cfg.num_experts_per_tok])
        w = s[chosen] / (s[chosen].sum() if cfg.norm_topk_prob else 1.0)
        ids.append(chosen)
        weights.append(w * cfg.routed_scaling_factor)
    return np.array(weights), np.array(ids)


@pytest.mark.parametrize(
    "scoring, method, with_bias",
    [
        ("softmax", "greedy", False),  # DeepSeek-V2-Lite
        ("softmax", "group_limited_greedy", False),  # DeepSeek-V2
        ("sigmoid", "noaux_tc", True),  # DeepSeek-V3
        ("sigmoid", "greedy", True),
        ("softmax", "group_limited_greedy", True),
    ],
)
def test_deepseek_topk_methods_match_numpy(scoring, method, with_bias):
    cfg = dataclasses.replace(
        config_lib.MoEConfig.tiny(), num_experts=16, n_group=4, topk_group=2,
        num_experts_per_tok=3, scoring_func=scoring, topk_method=method,
        use_score_correction_bias=with_bias, routed_scaling_factor=2.5, norm_topk_prob=False,
    )  # fmt: skip
    rng = np.random.default_rng(sum(map(ord, scoring + method)) + with_bias)
    logits = rng.normal(size=(9, 16)).astype(np.float32)
    bias = (0.3 * rng.normal(size=16)).astype(np.float32) if with_bias else None
    weights, ids = router.select_experts(logits, bias, cfg)
    want_w, want_ids = _deepseek_numpy(logits, 0.0 if bias is None else bias, cfg)
    order = np.argsort(np.asarray(ids), 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1), want_ids)
    got_w = np.take_along_axis(np.asarray(weights), order, 1)
    chex.assert_trees_all_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_unknown_topk_method_names_the_field():
    with pytest.raises(ValueError, match="topk_method='top1'"):
        dataclasses.replace(config_lib.MoEConfig.tiny(), topk_method="top1")
