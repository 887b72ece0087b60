"""DeepSeek-V2/V3 multi-head latent attention (MLA) projections; ``jtbo.attention.mla`` attends.

Per token ``x [H]``:

* query: ``x @ wq`` (no low rank, V2-Lite) or ``rms_norm(x @ wq_a) @ wq_b`` (``q_lora_rank``),
  giving per head ``[q_nope (qk_nope_head_dim), q_pe (qk_rope_head_dim)]``; RoPE on ``q_pe``;
* latent: ``x @ wkv_a = [c (kv_lora_rank), k_pe (qk_rope_head_dim)]``; ``c`` is RMS-normed,
  ``k_pe`` (one RoPE key shared by all heads) is rotated; ``[c, k_pe]`` is what the KV pool
  stores (``MoEConfig.kv_cache_head_dim``);
* ``wkv_b [kv_lora_rank, heads, nope + v]`` up-projects ``c`` to each head's key (nope part)
  and value; ``wo [heads, v_head_dim, H]`` projects the heads' outputs back.

The softmax scale is ``(nope + rope) ** -0.5``, times YaRN's ``mscale(factor,
mscale_all_dim) ** 2`` when the config's RoPE is YaRN (``rope.RopeScaling``). RoPE here uses the
NeoX half layout; DeepSeek's checkpoints rotate interleaved pairs, which the loader turns into
the half layout by permuting the rotated output columns of ``wq`` / ``wq_b`` and ``wkv_a`` (a
dot product does not change when both sides are permuted alike).

Sharding over ``attn_tp``: ``wq`` / ``wq_b``, ``wkv_b`` and ``wo`` split the head axis; ``wq_a``,
``wkv_a`` and the norms are replicated, so every rank computes the same latent and keeps its
own copy of the pool.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jtbo.models import config as config_lib
from jtbo.models import mlp, norm, rope, self_attention


def rope_scaling_of(config: config_lib.MoEConfig) -> rope.RopeScaling:
    """The config's RoPE frequencies and magnitudes."""
    return rope.RopeScaling(
        theta=config.rope_theta,
        factor=config.rope_scaling_factor,
        kind=config.rope_scaling_type,
        original_max_position=config.rope_yarn_original_max_position,
        beta_fast=config.rope_yarn_beta_fast,
        beta_slow=config.rope_yarn_beta_slow,
        mscale=config.rope_yarn_mscale,
        mscale_all_dim=config.rope_yarn_mscale_all_dim,
    )


class MLAttention(nnx.Module):
    """Projections of an MLA layer (see the module docstring)."""

    def __init__(self, config: config_lib.MoEConfig, *, rngs: nnx.Rngs):
        """Args: config: model config (``attention_kind="mla"``); rngs: init keys."""
        h, heads, rank = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
        qk, q_rank = config.qk_head_dim, config.q_lora_rank
        eps = config.rms_norm_eps
        if q_rank is None:
            self.wq = mlp.init_matrix(rngs, (h, heads, qk), h)  # [H, heads, nope + rope]
            self.wq_a = self.q_a_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = mlp.init_matrix(rngs, (h, q_rank), h)  # [H, q_lora_rank]
            self.q_a_norm = norm.RMSNorm(q_rank, eps=eps, rngs=rngs)
            self.wq_b = mlp.init_matrix(rngs, (q_rank, heads, qk), q_rank)  # [q_rank, heads, qk]
        self.wkv_a = mlp.init_matrix(rngs, (h, rank + config.qk_rope_head_dim), h)  # [H, r + rope]
        self.kv_a_norm = norm.RMSNorm(rank, eps=eps, rngs=rngs)
        self.wkv_b = mlp.init_matrix(
            rngs, (rank, heads, config.qk_nope_head_dim + config.v_head_dim), rank
        )  # [rank, heads, nope + v]
        self.wo = mlp.init_matrix(rngs, (heads, config.v_head_dim, h), heads * config.v_head_dim)
        self.rope = rope_scaling_of(config)
        self.nope = config.qk_nope_head_dim
        self.scaling = qk**-0.5 * self.rope.softmax_scale_factor

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Projects ``x [T, H]`` to ``(q_nope [T, heads, nope], q_pe [T, heads, rope],
        latent [T, kv_lora_rank + rope])``, RoPE applied to ``q_pe`` and the latent's key."""
        if self.wq is not None:
            q = jnp.einsum("th,hnd->tnd", x, self.wq[...])
        else:
            q_a = self.q_a_norm(jnp.dot(x, self.wq_a[...]))
            q = jnp.einsum("tr,rnd->tnd", q_a, self.wq_b[...])
        q_pe = rope.apply_scaled_rope(q[..., self.nope :], positions, self.rope)
        kv = jnp.dot(x, self.wkv_a[...])  # [T, rank + rope]
        rank = self.kv_a_norm.weight.shape[0]
        k_pe = rope.apply_scaled_rope(kv[:, None, rank:], positions, self.rope)[:, 0]
        latent = jnp.concatenate([self.kv_a_norm(kv[:, :rank]), k_pe], axis=-1)
        # At decode sizes XLA splits these projections' contraction and fuses the partial
        # sums' reduction into their consumers; fused into the absorbed attention's
        # transposing concatenation of the latent query it ran several times slower than the
        # reduction alone (docs/benchmarks/, "MLA decode launch"). The barrier has the
        # attention's inputs written once, before it reads them.
        return jax.lax.optimization_barrier((q[..., : self.nope], q_pe, latent))

    def attend(self, backend, qkv, layer_id, metadata, kv_cache):
        """Paged MLA of ``qkv`` through ``backend.forward_mla``; returns ``(out, kv_cache)``."""
        q_nope, q_pe, latent = qkv
        return backend.forward_mla(
            q_nope, q_pe, latent, self.wkv_b[...], layer_id, metadata, kv_cache,
            scaling=self.scaling,
        )  # fmt: skip

    def dense(self, qkv, mask: jax.Array) -> jax.Array:
        """Dense attention over all of ``qkv``'s tokens with keys and values up-projected
        (the reference forward's path); ``mask [L, L]``. Returns ``[L, heads, v_head_dim]``."""
        q_nope, q_pe, latent = qkv
        rank = self.kv_a_norm.weight.shape[0]
        kv = jnp.einsum("tr,rnd->tnd", latent[:, :rank], self.wkv_b[...])
        k_pe = jnp.broadcast_to(latent[:, None, rank:], (*kv.shape[:2], q_pe.shape[-1]))
        keys = jnp.concatenate([kv[..., : self.nope], k_pe], axis=-1)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        return self_attention.dense_attention(
            q, keys, kv[..., self.nope :], mask, scaling=self.scaling
        )

    def output(self, attn: jax.Array) -> jax.Array:
        """Projects ``attn [T, heads, v_head_dim]`` to ``[T, H]`` (partial sum over local heads)."""
        # In attn's dtype, as ``self_attention.SelfAttention.output`` (one rounding either way).
        # One contraction over the heads' flattened rows: as a two-axis contraction XLA gave
        # the absorbed attention's output a value-major layout and copied the whole weight
        # into it on every step.
        wo = self.wo[...]
        rows = attn.reshape(attn.shape[0], -1)  # [T, heads * v_head_dim], heads major
        return jnp.dot(rows, wo.reshape(-1, wo.shape[-1]), preferred_element_type=attn.dtype)
