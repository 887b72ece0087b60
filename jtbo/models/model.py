"""The MoE model as flax.nnx modules: embedding, decoder layers, final norm, LM head.

A decoder layer is ``x + attn(norm(x))`` (GQA, ``self_attention``, or DeepSeek's MLA,
``mla_attention``, by ``MoEConfig.attention_kind``) followed by ``x + ffn(norm(x))``, where
``ffn`` is a dense SwiGLU MLP for the first ``first_k_dense`` layers and a MoE block (router,
routed experts, optional shared experts, the latter optionally gated per token) afterwards;
which layers are MoE layers is ``MoEConfig.is_moe_layer``. With tied embeddings the LM head is
the embedding table (``MoEModel.logits``). How the layer runs (sharded, as operations, with TBO)
lives in ``jtbo.models.layer_ops`` and ``jtbo.models.step``; this module only holds parameters.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jtbo.models import config as config_lib
from jtbo.models import embed, experts, mla_attention, mlp, norm, router, self_attention


class MoEBlock(nnx.Module):
    """Router, routed experts and (optionally) the shared experts of one MoE layer."""

    def __init__(self, config: config_lib.MoEConfig, *, rngs: nnx.Rngs):
        """Args: config: model config; rngs: parameter init keys."""
        self.router = router.Router(config, rngs=rngs)
        self.experts = experts.RoutedExperts(config, rngs=rngs)
        width = config.shared_width
        self.shared = mlp.MLP(config.hidden_size, width, rngs=rngs) if width else None
        self.shared_gate = (
            mlp.init_matrix(rngs, (config.hidden_size,), config.hidden_size)  # [H]
            if config.shared_expert_gate
            else None
        )

    def shared_output(self, x: jax.Array) -> jax.Array:
        """The shared experts' output for ``x [T, H]`` (times ``sigmoid(x @ gate)`` if gated)."""
        out = self.shared(x)
        if self.shared_gate is None:
            return out
        f32 = jnp.float32
        scale = jax.nn.sigmoid(jnp.dot(x, self.shared_gate[...], preferred_element_type=f32))
        return (out.astype(f32) * scale[:, None]).astype(out.dtype)


class DecoderLayer(nnx.Module):
    """One decoder layer: norms, attention, and a dense MLP or a MoE block."""

    def __init__(self, config: config_lib.MoEConfig, layer_id: int, *, rngs: nnx.Rngs):
        """Args: config: model config; layer_id: index in the stack; rngs: init keys."""
        self.layer_id = layer_id
        self.is_moe = config.is_moe_layer[layer_id]
        eps = config.rms_norm_eps
        self.input_norm = norm.RMSNorm(config.hidden_size, eps=eps, rngs=rngs)
        if config.attention_kind == "mla":
            self.attn = mla_attention.MLAttention(config, rngs=rngs)
        else:
            self.attn = self_attention.SelfAttention(config, rngs=rngs)
        self.post_attn_norm = norm.RMSNorm(config.hidden_size, eps=eps, rngs=rngs)
        if self.is_moe:
            self.moe = MoEBlock(config, rngs=rngs)
        else:
            self.mlp = mlp.MLP(config.hidden_size, config.intermediate_size, rngs=rngs)


class MoEModel(nnx.Module):
    """DeepSeek/Qwen-style MoE language model (parameters in float32 at creation).

    Cast with ``jtbo.models.cast(model, dtype)`` before serving in another dtype.
    """

    def __init__(self, config: config_lib.MoEConfig, *, rngs: nnx.Rngs):
        """Args: config: model shapes; rngs: parameter init keys (``nnx.Rngs(seed)``)."""
        self.config = config
        self.embed = embed.Embedding(config.vocab_size, config.hidden_size, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(config, i, rngs=rngs) for i in range(config.num_layers)]
        )
        self.final_norm = norm.RMSNorm(config.hidden_size, eps=config.rms_norm_eps, rngs=rngs)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else embed.LMHead(config.hidden_size, config.vocab_size, rngs=rngs)
        )

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Float32 logits ``[T, V]`` of final-normed ``hidden [T, H]`` (the LM head, or the
        embedding table when the embeddings are tied)."""
        if self.lm_head is None:
            table = self.embed.table[...]
            return jnp.einsum("th,vh->tv", hidden, table, preferred_element_type=jnp.float32)
        return self.lm_head(hidden)


def cast(model: MoEModel, dtype) -> MoEModel:
    """Returns a copy of ``model`` whose parameters have ``dtype``, but those stored in their
    own dtype (``experts.StoredDtypeParam``: FP8 routed experts and their scales).

    Args:
      model: the model.
      dtype: e.g. ``jnp.bfloat16``.

    Returns:
      A new ``MoEModel`` (``model`` is left unchanged).
    """
    graphdef, kept, state = nnx.split(model, experts.StoredDtypeParam, ...)
    return nnx.merge(graphdef, kept, jax.tree.map(lambda a: a.astype(dtype), state))
