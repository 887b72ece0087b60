"""Bytes of a model's parameters from its ``MoEConfig`` alone, and one device's share of them.

Every parameter ``MoEModel(config)`` holds is counted from the config's sizes (the tests check
the counts against the model's own parameters), in three groups by how the compiled step
shards them (``jtbo.models.step.param_specs``):

* the routed experts, split over every device of the mesh (whole experts with expert
  parallelism, a slice of each expert's hidden width without);
* the attention projections split by heads over ``attn_tp`` (GQA's ``wqkv``, ``bqkv``, ``wo``;
  MLA's ``wq`` / ``wq_b``, ``wkv_b``, ``wo``);
* everything else, on every device (embedding, LM head, norms, routers, MLA's ``wq_a`` and
  ``wkv_a``, dense and shared-expert MLPs).

The routed experts take ``config.expert_dtype``'s bytes (FP8: one byte per value plus a
float32 scale per ``expert_block_size`` block of each expert matrix), the rest the serving
dtype's. ``python -m jtbo.bench predict --expert-dtype ...`` prints the per-GPU bytes.
"""

import dataclasses

from jtbo.core import arith

FP8_SCALE_BYTES = 4
"""Bytes of one FP8 block scale (float32)."""


@dataclasses.dataclass(frozen=True)
class ParameterBytes:
    """A model's parameter bytes by sharding group (module docstring).

    Attributes:
      routed_experts: the routed experts' weights of every layer (FP8: values and scales).
      attention_heads: the attention projections split over ``attn_tp``.
      replicated: the parameters every device holds whole.
    """

    routed_experts: int
    attention_heads: int
    replicated: int

    @property
    def total(self) -> int:
        """All parameters' bytes (the model on one device)."""
        return self.routed_experts + self.attention_heads + self.replicated

    def per_device(self, num_devices: int, attn_tp_size: int = 1) -> float:
        """Bytes on one device of a ``num_devices`` mesh whose DP ranks have ``attn_tp_size``
        devices each.

        Raises:
          ValueError: ``num_devices`` not a positive multiple of ``attn_tp_size``.
        """
        if num_devices < 1 or attn_tp_size < 1 or num_devices % attn_tp_size:
            raise ValueError(
                f"num_devices={num_devices} must be a positive multiple of "
                f"attn_tp_size={attn_tp_size}"
            )
        routed = self.routed_experts / num_devices
        return self.replicated + self.attention_heads / attn_tp_size + routed


def _attention(config) -> tuple[int, int]:
    """``(head-split, replicated)`` elements of one layer's attention."""
    h, heads = config.hidden_size, config.num_attention_heads
    if config.attention_kind == "mla":
        rank, q_rank, qk = config.kv_lora_rank, config.q_lora_rank, config.qk_head_dim
        split = rank * heads * (config.qk_nope_head_dim + config.v_head_dim)  # wkv_b
        split += heads * config.v_head_dim * h  # wo
        replicated = h * (rank + config.qk_rope_head_dim) + rank  # wkv_a, kv_a_norm
        if q_rank is None:
            return split + h * heads * qk, replicated  # wq
        return split + q_rank * heads * qk, replicated + h * q_rank + q_rank  # wq_b; wq_a, norm
    d, kv_heads = config.head_dim, config.num_key_value_heads
    qkv = kv_heads * (heads // kv_heads + 2) * d
    split = h * qkv + heads * d * h + (qkv if config.qkv_bias else 0)  # wqkv, wo, bqkv
    return split, 2 * d if config.qk_norm else 0


def _routed_expert_bytes(config, itemsize: int) -> int:
    """One MoE layer's routed experts: all ``E`` experts' gate, up and down matrices."""
    e, h, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
    if config.expert_dtype is None:
        return 3 * e * h * f * itemsize
    bk, bn = config.expert_block_size
    blocks = 2 * arith.ceil_div(h, bk) * arith.ceil_div(f, bn)  # gate and up: [H, F] each
    blocks += arith.ceil_div(f, bk) * arith.ceil_div(h, bn)  # down: [F, H]
    return 3 * e * h * f + e * blocks * FP8_SCALE_BYTES


def _ffn(config, moe: bool) -> int:
    """Replicated elements of one layer's dense MLP, or of its router and shared experts."""
    h = config.hidden_size
    if not moe:
        return 3 * h * config.intermediate_size
    router = h * config.num_experts + (
        config.num_experts if config.use_score_correction_bias else 0
    )
    shared = 3 * h * config.shared_width + (h if config.shared_expert_gate else 0)
    return router + shared


def parameter_bytes(config, itemsize: int = 2) -> ParameterBytes:
    """The parameter bytes of ``MoEModel(config)`` served in a dtype of ``itemsize`` bytes.

    Args:
      config: the model (``jtbo.models.config.MoEConfig``).
      itemsize: bytes per value of every parameter but FP8 routed experts (2: bf16).

    Returns:
      The ``ParameterBytes``.
    """
    h, v = config.hidden_size, config.vocab_size
    replicated = v * h * (1 if config.tie_word_embeddings else 2) + h  # embed, LM head, norm
    split, routed = 0, 0
    for moe in config.is_moe_layer:
        heads, whole = _attention(config)
        split += heads
        replicated += whole + 2 * h + _ffn(config, moe)  # the layer's two norms
        routed += _routed_expert_bytes(config, itemsize) if moe else 0
    return ParameterBytes(routed, split * itemsize, replicated * itemsize)
