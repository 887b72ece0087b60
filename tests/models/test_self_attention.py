"""The fused ``wqkv`` layout: query head ``j`` reads KV head ``j // group``'s block."""

import dataclasses

import chex
import numpy as np
from flax import nnx

from jtbo.models import config as config_lib
from jtbo.models import rope, self_attention


def _attention(seed: int):
    config = dataclasses.replace(
        config_lib.MoEConfig.tiny(), num_attention_heads=6, num_key_value_heads=2
    )
    return config, self_attention.SelfAttention(config, rngs=nnx.Rngs(seed))


def test_qkv_matches_numpy_per_head():
    config, attn = _attention(0)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, config.hidden_size)).astype(np.float32)
    positions = rng.integers(0, 50, size=5)
    q, k, v = attn.qkv(x, positions)
    w = np.asarray(attn.wqkv[...])  # [H, kv_heads, group + 2, D]
    group = config.num_attention_heads // config.num_key_value_heads
    want_q = np.stack([x @ w[:, j // group, j % group] for j in range(6)], axis=1)
    want_k = np.stack([x @ w[:, n, group] for n in range(2)], axis=1)
    want_v = np.stack([x @ w[:, n, group + 1] for n in range(2)], axis=1)
    theta = config.rope_theta
    chex.assert_trees_all_close(
        (q, k, v),
        (rope.apply_rope(want_q, positions, theta), rope.apply_rope(want_k, positions, theta),
         want_v),
        rtol=1e-4, atol=1e-4,
    )  # fmt: skip


def test_wqkv_shape_and_kv_head_split():
    config, attn = _attention(2)
    assert attn.wqkv[...].shape == (config.hidden_size, 2, 5, config.head_dim)
    # A KV-head shard (as attn_tp sees it) yields that KV head's own query heads.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, config.hidden_size)).astype(np.float32)
    positions = np.arange(4)
    q_full, k_full, _ = attn.qkv(x, positions)
    attn.wqkv = nnx.Param(attn.wqkv[...][:, 1:])
    q_shard, k_shard, _ = attn.qkv(x, positions)
    chex.assert_trees_all_close((q_shard, k_shard), (q_full[:, 3:], k_full[:, 1:]), atol=1e-6)
