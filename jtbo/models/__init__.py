"""jtbo.models: a Flax (nnx) DeepSeek/Qwen-style MoE model built from jtbo operations.

Parameters live in ``MoEModel``; the math is in small pure functions beside each module
(``rms_norm``, ``apply_rope``, ``select_experts``, ``experts_capacity``, ...); each layer's
forward is exposed as operations with SGLang's strategy names (``layer_ops``) and the sharded
step is one ``shard_map`` (``step``). ``reference_forward`` is the unsharded oracle that the
tests and ``python -m jtbo.demo`` check the runner against.
``jtbo.models.hf`` loads and saves Hugging Face checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral).
"""

from jtbo.models.config import MoEConfig
from jtbo.models.experts import experts_capacity, experts_ragged_dot_reference, experts_sorted
from jtbo.models.layer_ops import (
    MoEOptions,
    ParallelConfig,
    attention_operations,
    dense_layer_operations,
    moe_layer_operations,
)
from jtbo.models.model import DecoderLayer, MoEBlock, MoEModel, cast
from jtbo.models.reference import causal_mask, reference_causal_logits, reference_forward
from jtbo.models.router import select_experts
from jtbo.models.step import make_step, param_specs

__all__ = [
    "DecoderLayer",
    "MoEBlock",
    "MoEConfig",
    "MoEModel",
    "MoEOptions",
    "ParallelConfig",
    "attention_operations",
    "cast",
    "causal_mask",
    "dense_layer_operations",
    "experts_capacity",
    "experts_ragged_dot_reference",
    "experts_sorted",
    "make_step",
    "moe_layer_operations",
    "param_specs",
    "reference_causal_logits",
    "reference_forward",
    "select_experts",
]
