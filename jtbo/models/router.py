"""MoE router: gate logits -> (expert ids, weights) per token.

Scores are ``softmax`` (Qwen/Mixtral, DeepSeek-V2) probabilities over all experts or
``sigmoid`` (DeepSeek-V3) independent scores. The *choice* (DeepSeek's ``topk_method``) uses the
scores plus the optional per-expert correction bias:

* ``greedy``: the top-k over all experts;
* ``group_limited_greedy`` (V2): experts fall into ``n_group`` contiguous groups, each rated by
  its best score; only the ``topk_group`` best groups stay eligible for the top-k;
* ``noaux_tc`` (V3): the same, with a group rated by the sum of its two best biased scores.

The *weights* are the unbiased scores of the chosen experts.

Either way the weights are optionally renormalised to sum to one, then multiplied by
``routed_scaling_factor``.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jtbo.models import config as config_lib


def softmax_topk(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Returns ``(weights [T, k] float32, ids [T, k] int32)`` of the top-k softmax experts."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    return weights, ids.astype(jnp.int32)


def grouped_topk(
    scores: jax.Array,
    bias: jax.Array,
    top_k: int,
    n_group: int,
    topk_group: int,
    group_rating: str = "top2_sum",
) -> tuple[jax.Array, jax.Array]:
    """Group-limited top-k over biased scores (DeepSeek ``noaux_tc`` / ``group_limited_greedy``).

    Args:
      scores: ``[T, E]`` float32 scores.
      bias: ``[E]`` score-correction bias (only affects which experts are chosen).
      top_k: experts per token.
      n_group: groups the experts fall into (contiguous, ``E / n_group`` each).
      topk_group: groups kept per token.
      group_rating: "top2_sum" (a group's two best biased scores, V3) or "max" (its best, V2).

    Returns:
      ``(weights [T, k], ids [T, k] int32)``; weights are the unbiased scores.
    """
    num_tokens, num_experts = scores.shape
    biased = scores + bias[None, :]
    grouped = biased.reshape(num_tokens, n_group, num_experts // n_group)
    if group_rating == "max":
        group_rating_value = jnp.max(grouped, axis=-1)
    else:
        group_rating_value = jnp.sum(jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0], axis=-1)
    _, kept_groups = jax.lax.top_k(group_rating_value, topk_group)  # [T, topk_group]
    group_mask = (
        jnp.zeros((num_tokens, n_group), bool)
        .at[jnp.arange(num_tokens)[:, None], kept_groups]
        .set(True)
    )
    eligible = jnp.repeat(group_mask, num_experts // n_group, axis=1)  # [T, E]
    _, ids = jax.lax.top_k(jnp.where(eligible, biased, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    return weights, ids.astype(jnp.int32)


def select_experts(
    logits: jax.Array, bias: jax.Array | None, config: config_lib.MoEConfig
) -> tuple[jax.Array, jax.Array]:
    """Chooses ``config.num_experts_per_tok`` experts per token from gate logits.

    Args:
      logits: ``[T, E]`` router logits.
      bias: ``[E]`` score-correction bias, or None when the config has none.
      config: scoring rule, grouping, normalisation and scaling.

    Returns:
      ``(topk_weights [T, k] float32, topk_ids [T, k] int32)``.
    """
    k, method = config.num_experts_per_tok, config.router_topk_method
    if config.scoring_func == "softmax" and method == "greedy" and bias is None:
        weights, ids = softmax_topk(logits, k)
    else:
        logits = logits.astype(jnp.float32)
        if config.scoring_func == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        zero = jnp.zeros((scores.shape[-1],), jnp.float32)
        bias32 = zero if bias is None else bias.astype(jnp.float32)
        groups = (1, 1) if method == "greedy" else (config.n_group, config.topk_group)
        rating = "max" if method == "group_limited_greedy" else "top2_sum"
        weights, ids = grouped_topk(scores, bias32, k, *groups, group_rating=rating)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * config.routed_scaling_factor, ids


class Router(nnx.Module):
    """Gate projection ``[hidden, experts]`` plus the optional score-correction bias."""

    def __init__(self, config: config_lib.MoEConfig, *, rngs: nnx.Rngs):
        """Args: config: model config; rngs: parameter init keys."""
        scale = config.hidden_size**-0.5
        shape = (config.hidden_size, config.num_experts)
        self.weight = nnx.Param(scale * jax.random.normal(rngs.params(), shape))  # [H, E]
        self.correction_bias = (
            nnx.Param(0.05 * jax.random.normal(rngs.params(), (config.num_experts,)))  # [E]
            if config.use_score_correction_bias
            else None
        )

    def gate(self, x: jax.Array) -> jax.Array:
        """Returns router logits ``[T, E]`` in float32 for ``x [T, H]``."""
        return jnp.dot(x.astype(jnp.float32), self.weight[...].astype(jnp.float32))
