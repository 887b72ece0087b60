"""GQA self-attention projections with RoPE; the attention core is supplied by the caller.

The Q, K and V projections are one fused weight, ``wqkv [H, kv_heads, group + 2, D]`` (SGLang's
``qkv_proj``): for every KV head, its ``group = heads // kv_heads`` query heads, then its key,
then its value. One matmul per call matters for two-batch overlap: with three weights, XLA's
dot merger joins a micro-batch's Q, K and V matmuls (they share the activations) and so can no
longer join micro-batch A's and B's (they share a weight), and each micro-batch reads the
weight on its own; in prefill XLA concatenated the three weights at run time, every step
(docs/benchmarks/, "TBO step cost on one H200", fused weights and one CUDA graph per step,
"GPU time"). Query head ``j`` lives at
``(j // group, j % group)``, the usual GQA order, so sharding the ``kv_heads`` axis over
``attn_tp`` gives each rank ``kv_heads / attn_tp`` KV heads with their own query heads.
``wo [heads, D, H]`` keeps the head axis explicit; ``output`` returns a partial sum over the
rank's heads, which the caller reduces over ``attn_tp``.

Options of some families (``MoEConfig``): ``qkv_bias`` adds ``bqkv [kv_heads, group + 2, D]``
(Qwen2) in the same head layout, so it shards with ``wqkv``; ``qk_norm`` applies a per-head
RMSNorm (one ``[D]`` weight for all query heads, one for all key heads; Qwen3) to queries and
keys before RoPE.

``dense_attention`` is the plain-jnp core over a full context with an explicit mask: the
unsharded reference uses it, and it defines what the paged-KV backends must reproduce.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jtbo.models import config as config_lib
from jtbo.models import mlp, norm, rope


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scaling: float | None = None
) -> jax.Array:
    """Masked softmax attention with GQA head sharing, in float32 (or wider inputs' dtype).

    Args:
      q: ``[L, heads, D]`` queries.
      k: ``[S, kv_heads, D]`` keys; v: ``[S, kv_heads, Dv]`` values.
      mask: ``[L, S]`` bool, True where query ``l`` may attend to key ``s``.
      scaling: softmax scale; None: ``D ** -0.5``.

    Returns:
      ``[L, heads, Dv]`` in ``q.dtype``; a row with no allowed key returns zeros.
    """
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    group = q.shape[1] // k.shape[1]
    wide = jnp.promote_types(q.dtype, jnp.float32)
    k = jnp.repeat(k.astype(wide), group, axis=1)
    v = jnp.repeat(v.astype(wide), group, axis=1)
    scores = jnp.einsum("lhd,shd->hls", q.astype(wide), k) * scaling
    scores = jnp.where(mask[None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("hls,shd->lhd", probs, v).astype(q.dtype)


class SelfAttention(nnx.Module):
    """Q/K/V/O projections of a GQA attention layer."""

    def __init__(self, config: config_lib.MoEConfig, *, rngs: nnx.Rngs):
        """Args: config: model config; rngs: parameter init keys."""
        h, d = config.hidden_size, config.head_dim
        nq, nkv = config.num_attention_heads, config.num_key_value_heads
        self.wqkv = mlp.init_matrix(rngs, (h, nkv, nq // nkv + 2, d), h)  # [H, kv_heads, g+2, D]
        self.wo = mlp.init_matrix(rngs, (nq, d, h), nq * d)  # [heads, D, H]
        self.bqkv = (
            nnx.Param(0.1 * jax.random.normal(rngs.params(), (nkv, nq // nkv + 2, d)))
            if config.qkv_bias
            else None
        )  # [kv_heads, group + 2, D]
        eps = config.rms_norm_eps
        self.q_norm = norm.RMSNorm(d, eps=eps, rngs=rngs) if config.qk_norm else None
        self.k_norm = norm.RMSNorm(d, eps=eps, rngs=rngs) if config.qk_norm else None
        self.rope_theta = config.rope_theta
        self.rope_scaling_factor = config.rope_scaling_factor

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Projects ``x [T, H]`` to ``q [T, heads, D]``, ``k, v [T, kv_heads, D]``; RoPE on q, k."""
        qkv = jnp.einsum("th,hngd->tngd", x, self.wqkv[...])  # [T, kv_heads, group + 2, D]
        if self.bqkv is not None:
            qkv = qkv + self.bqkv[...].astype(qkv.dtype)
        group = qkv.shape[2] - 2
        q = qkv[:, :, :group].reshape(qkv.shape[0], -1, qkv.shape[3])  # [T, heads, D]
        k, v = qkv[:, :, group], qkv[:, :, group + 1]  # [T, kv_heads, D] each
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope.apply_rope(q, positions, self.rope_theta, self.rope_scaling_factor)
        k = rope.apply_rope(k, positions, self.rope_theta, self.rope_scaling_factor)
        return q, k, v

    def attend(self, backend, qkv, layer_id, metadata, kv_cache):
        """Paged attention of ``qkv`` through ``backend.forward``; returns ``(out, kv_cache)``."""
        return backend.forward(*qkv, layer_id, metadata, kv_cache)

    def dense(self, qkv, mask: jax.Array) -> jax.Array:
        """``dense_attention`` over all of ``qkv``'s tokens (the reference forward's path)."""
        return dense_attention(*qkv, mask)

    def output(self, attn: jax.Array) -> jax.Array:
        """Projects ``attn [T, heads, D]`` back to ``[T, H]`` (partial sum over local heads)."""
        # In attn's dtype: the GPU's dot accumulates in float32 and rounds once either way, and a
        # float32 result would cost a separate convert wherever XLA picks cuBLAS.
        return jnp.einsum("tnd,ndh->th", attn, self.wo[...], preferred_element_type=attn.dtype)
