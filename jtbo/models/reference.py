"""Unsharded single-device reference forward in plain jnp: the oracle for end-to-end tests and
the demo's check (``python -m jtbo.demo`` compares a runner step with it in float64).

It shares only the model's parameters and the small pure pieces that are tested against numpy
on their own (``rms_norm``, ``apply_rope``, ``select_experts``, ``swiglu``). Everything that the
served path changes is done the obvious way here: attention is dense over the whole sequence
with an explicit ``[L, L]`` mask (no paged KV cache, no metadata), every expert runs on every
token and is weighted by a dense ``[T, E]`` routing matrix (no capacity, no dispatch), and
nothing is sharded, padded, split or overlapped.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo.core import arith
from jtbo.models import experts, norm, router
from jtbo.models import model as model_lib


def causal_mask(length: int) -> np.ndarray:
    """Returns the ``[length, length]`` lower-triangular bool mask."""
    return np.tril(np.ones((length, length), bool))


def moe_dense_reference(block: model_lib.MoEBlock, x: jax.Array, config) -> jax.Array:
    """MoE output for ``x [T, H]`` with every expert applied to every token.

    Args:
      block: the layer's MoE parameters.
      x: ``[T, H]`` normalised hidden states.
      config: the model's ``MoEConfig``.

    Returns:
      ``[T, H]`` routed (plus shared) expert output.
    """
    bias = None if block.router.correction_bias is None else block.router.correction_bias[...]
    topk_weights, topk_ids = router.select_experts(block.router.gate(x), bias, config)
    tokens = jnp.arange(x.shape[0])[:, None]
    dense = jnp.zeros((x.shape[0], config.num_experts), jnp.float32)
    dense = dense.at[tokens, topk_ids].add(topk_weights)  # [T, E]
    w_gate_up, w_down = experts.float_weights(block.experts.weights, x.dtype)
    through_fp8 = experts.activation_rounding(block.experts.activation_groups, x.dtype)
    rows = through_fp8(x, 0)
    gate = jnp.einsum("th,ehf->tef", rows, w_gate_up[:, :, 0])
    up = jnp.einsum("th,ehf->tef", rows, w_gate_up[:, :, 1])
    per_expert = jnp.einsum("tef,efh->teh", through_fp8(jax.nn.silu(gate) * up, 1), w_down)
    out = jnp.einsum("teh,te->th", per_expert, dense)
    if block.shared is not None:
        out = out + block.shared_output(x)
    return out


def reference_forward(model: model_lib.MoEModel, input_ids, positions, mask) -> jax.Array:
    """Logits of one sequence, all tokens at once.

    Args:
      model: the (float32) model.
      input_ids: ``[L]`` token ids of the whole sequence (prefix and new tokens).
      positions: ``[L]`` RoPE positions.
      mask: ``[L, L]`` bool, True where token ``l`` attends to token ``s``.

    Returns:
      ``[L, V]`` float32 logits.
    """
    config = model.config
    hidden = model.embed(jnp.asarray(input_ids))
    positions, mask = jnp.asarray(positions), jnp.asarray(mask)
    for layer in model.layers:
        normed = layer.input_norm(hidden)
        qkv = layer.attn.qkv(normed, positions)
        hidden = hidden + layer.attn.output(layer.attn.dense(qkv, mask))
        normed = layer.post_attn_norm(hidden)
        if layer.is_moe:
            hidden = hidden + moe_dense_reference(layer.moe, normed, config)
        else:
            hidden = hidden + layer.mlp(normed)
    return model.logits(norm.rms_norm(hidden, model.final_norm.weight[...], config.rms_norm_eps))


@functools.partial(jax.jit, static_argnums=0)
def _forward_jit(graphdef, state, input_ids, positions, mask):
    return reference_forward(nnx.merge(graphdef, state), input_ids, positions, mask)


def reference_forward_padded(
    model: model_lib.MoEModel, input_ids, positions, mask, multiple: int = 32
) -> np.ndarray:
    """``reference_forward`` jitted, with the sequence padded to a multiple of ``multiple``.

    Padding rows and columns are masked out, so real rows are unchanged; padding keeps the
    number of compiles small when many sequence lengths are checked.

    Returns:
      ``[L, V]`` numpy logits of the real rows.
    """
    length = len(input_ids)
    padded = arith.round_up(length, multiple)
    ids = np.zeros(padded, np.int32)
    pos = np.zeros(padded, np.int32)
    full_mask = np.zeros((padded, padded), bool)
    ids[:length], pos[:length], full_mask[:length, :length] = input_ids, positions, mask
    graphdef, state = nnx.split(model)
    return np.asarray(_forward_jit(graphdef, state, ids, pos, full_mask))[:length]


def reference_causal_logits(model: model_lib.MoEModel, token_ids) -> np.ndarray:
    """Causal-LM logits ``[L, V]`` (numpy) of one sequence with positions ``0..L-1``."""
    length = len(token_ids)
    return reference_forward_padded(
        model, np.asarray(token_ids), np.arange(length), causal_mask(length)
    )
