"""Hugging Face ``config.json`` <-> ``MoEConfig`` for the supported model families.

Families: ``qwen3_moe`` (Qwen3-MoE: per-head q/k RMSNorm, no shared expert), ``qwen2_moe``
(Qwen1.5/2-MoE: q/k/v bias, one shared expert scaled per token by ``sigmoid(x @ w)``) and
``mixtral``. All three route with a softmax top-k; Qwen renormalises the chosen weights only
with ``norm_topk_prob``, Mixtral always. Qwen's ``decoder_sparse_step`` / ``mlp_only_layers``
make some layers dense (``MoEConfig.is_moe_layer`` reproduces the rule).

Every field of ``config.json`` is accounted for: mapped to a ``MoEConfig`` field, checked
against the values jtbo implements (sliding-window attention, other activations, attention
output bias, RoPE types other than ``default`` / ``linear``), or known to leave inference
unchanged (token ids, initialiser, training-only router losses, ...). Anything else raises
``ValueError`` naming the field: a checkpoint is never served with a setting silently dropped.
RoPE is read from transformers 5's ``rope_parameters`` or the older ``rope_theta`` +
``rope_scaling``; it is written as ``rope_parameters``.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from jtbo.models import config as config_lib

IGNORED_FIELDS = frozenset(
    {
        "_name_or_path", "architectures", "model_type", "transformers_version", "dtype",
        "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
        "use_cache", "max_position_embeddings", "attention_dropout", "output_router_logits",
        "router_aux_loss_coef", "router_jitter_noise", "output_attentions",
        "output_hidden_states", "return_dict", "use_bfloat16", "tie_encoder_decoder",
    }
)  # fmt: skip
"""Fields that do not change inference (training-only, generation or bookkeeping)."""
_REQUIRED = object()


class _Fields:
    """Reads a ``config.json`` dict, remembering which fields were looked at."""

    def __init__(self, raw: dict, model_type: str):
        self.raw, self.model_type = raw, model_type
        self.seen = set(IGNORED_FIELDS)

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        self.seen.add(key)
        if key in self.raw:
            return self.raw[key]
        if default is _REQUIRED:
            raise ValueError(f"{self.model_type} config.json lacks the field {key}")
        return default

    def expect(self, key: str, allowed: tuple, default: Any, why: str) -> Any:
        value = self.get(key, default)
        if value not in allowed:
            raise ValueError(
                f"unsupported config field {key}={value!r} (expected one of {list(allowed)}): {why}"
            )
        return value

    def check_all_seen(self) -> None:
        unknown = sorted(set(self.raw) - self.seen)
        if unknown:
            raise ValueError(
                f"unsupported config field(s) {unknown} for model_type {self.model_type!r}: jtbo "
                f"does not know what they change (known: {sorted(self.seen - IGNORED_FIELDS)})"
            )


def _rope(fields: _Fields, default_theta: float) -> tuple[float, float]:
    """``(rope_theta, linear scaling factor)`` from either RoPE spelling."""
    params = fields.get("rope_parameters", None)
    legacy_theta = fields.get("rope_theta", None)
    scaling = fields.get("rope_scaling", None)
    if params is None:
        params = dict(scaling or {})
        params.setdefault("rope_theta", default_theta if legacy_theta is None else legacy_theta)
    kind = params.get("rope_type", params.get("type", "default"))
    field = "rope_parameters" if fields.raw.get("rope_parameters") is not None else "rope_scaling"
    if kind not in ("default", "linear"):
        raise ValueError(
            f"unsupported config field {field}.rope_type={kind!r} (expected one of "
            "['default', 'linear'])"
        )
    known = {"rope_type", "type", "rope_theta"} | ({"factor"} if kind == "linear" else set())
    extra = sorted(set(params) - known)
    if extra:
        raise ValueError(f"unsupported config field(s) {field}.{extra} for rope_type {kind!r}")
    factor = float(params["factor"]) if kind == "linear" else 1.0
    return float(params.get("rope_theta", default_theta)), factor


def _layer_types(fields: _Fields) -> None:
    layer_types = fields.get("layer_types", None) or []
    others = sorted({kind for kind in layer_types if kind != "full_attention"})
    if others:
        raise ValueError(
            f"unsupported config field layer_types with {others} (expected only "
            "'full_attention'): sliding-window attention is not implemented"
        )


def _common(fields: _Fields, default_theta: float) -> dict:
    """The ``MoEConfig`` fields every family spells the same way."""
    fields.expect("hidden_act", ("silu",), "silu", "jtbo's MLPs are SwiGLU")
    heads = fields.get("num_attention_heads")
    hidden = fields.get("hidden_size")
    theta, factor = _rope(fields, default_theta)
    _layer_types(fields)
    return dict(
        vocab_size=fields.get("vocab_size"),
        hidden_size=hidden,
        num_layers=fields.get("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=fields.get("num_key_value_heads", None) or heads,
        head_dim=fields.get("head_dim", None) or hidden // heads,
        rope_theta=theta,
        rope_scaling_factor=factor,
        rms_norm_eps=fields.get("rms_norm_eps"),
        num_experts_per_tok=fields.get("num_experts_per_tok"),
        tie_word_embeddings=fields.get("tie_word_embeddings", False),
        first_k_dense=0,
        scoring_func="softmax",
        n_group=1,
        topk_group=1,
        use_score_correction_bias=False,
        routed_scaling_factor=1.0,
    )


def _qwen_common(fields: _Fields) -> dict:
    fields.expect(
        "use_sliding_window", (False,), False, "sliding-window attention is not implemented"
    )
    fields.get("sliding_window", None)  # unused while use_sliding_window is False
    fields.get("max_window_layers", None)  # likewise
    return dict(
        _common(fields, 10000.0),
        intermediate_size=fields.get("intermediate_size"),
        moe_intermediate_size=fields.get("moe_intermediate_size"),
        norm_topk_prob=fields.get("norm_topk_prob", False),
        decoder_sparse_step=fields.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(fields.get("mlp_only_layers", None) or ()),
    )


def _qwen3_moe_config(fields: _Fields) -> dict:
    # transformers 5 writes num_local_experts (an alias), the published checkpoints num_experts.
    experts, alias = fields.get("num_experts", None), fields.get("num_local_experts", None)
    experts = experts if experts is not None else alias
    if experts is None:
        raise ValueError("qwen3_moe config.json lacks the field num_experts (or num_local_experts)")
    fields.expect("attention_bias", (False,), False, "attention projection biases")
    return dict(_qwen_common(fields), num_experts=experts, num_shared_experts=0, qk_norm=True)


def _qwen2_moe_config(fields: _Fields) -> dict:
    width = fields.get("shared_expert_intermediate_size")
    if width <= 0:
        raise ValueError(f"unsupported config field shared_expert_intermediate_size={width}")
    return dict(
        _qwen_common(fields),
        num_experts=fields.get("num_experts"),
        num_shared_experts=1,
        shared_expert_intermediate_size=width,
        shared_expert_gate=True,
        qkv_bias=fields.get("qkv_bias", True),
    )


def _mixtral_config(fields: _Fields) -> dict:
    fields.expect("sliding_window", (None,), None, "sliding-window attention is not implemented")
    width = fields.get("intermediate_size")
    return dict(
        _common(fields, 1000000.0),
        intermediate_size=width,
        moe_intermediate_size=width,
        num_experts=fields.get("num_local_experts"),
        num_shared_experts=0,
        norm_topk_prob=True,
    )


@dataclasses.dataclass(frozen=True)
class Family:
    """One supported ``model_type``: its config reader and its tensor names.

    Attributes:
      model_type: ``config.json``'s ``model_type``.
      architecture: the ``architectures`` entry written on save.
      moe_prefix: the MoE block's name inside a layer (``mlp`` / ``block_sparse_moe``).
      expert_projections: an expert's (gate, up, down) projection names.
      read_config: ``_Fields -> MoEConfig`` keyword arguments.
    """

    model_type: str
    architecture: str
    moe_prefix: str
    expert_projections: tuple[str, str, str]
    read_config: Callable[[_Fields], dict]

    def to_moe_config(self, raw: dict) -> config_lib.MoEConfig:
        """The ``MoEConfig`` of a ``config.json`` of this family.

        Raises:
          ValueError: a missing required field, an unsupported value or an unknown field
            (named, with the expected and found values), or a config ``MoEConfig`` refuses.
        """
        fields = _Fields(raw, self.model_type)
        kwargs = self.read_config(fields)
        fields.check_all_seen()
        return config_lib.MoEConfig(**kwargs)

    def to_hf_config(self, config: config_lib.MoEConfig) -> dict:
        """The ``config.json`` of this family for ``config``.

        Raises:
          ValueError: ``config`` uses something this family cannot express (names the field).
        """
        _check_expressible(self, config)
        raw = dict(
            architectures=[self.architecture], model_type=self.model_type,
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
            hidden_act="silu", rms_norm_eps=config.rms_norm_eps,
            rope_parameters=_rope_parameters(config),
            num_experts_per_tok=config.num_experts_per_tok,
            tie_word_embeddings=config.tie_word_embeddings,
        )  # fmt: skip
        if self.model_type == "mixtral":
            raw.update(
                num_local_experts=config.num_experts,
                intermediate_size=config.moe_intermediate_size,
                sliding_window=None,
            )
            return raw
        dense = sorted(set(config.mlp_only_layers) | set(range(config.first_k_dense)))
        raw.update(
            num_experts=config.num_experts, intermediate_size=config.intermediate_size,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=config.decoder_sparse_step,
            mlp_only_layers=dense, use_sliding_window=False,
        )  # fmt: skip
        if self.model_type == "qwen2_moe":
            raw.update(
                shared_expert_intermediate_size=config.shared_width, qkv_bias=config.qkv_bias
            )
        else:
            raw.update(attention_bias=False)
        return raw


def _rope_parameters(config: config_lib.MoEConfig) -> dict:
    if config.rope_scaling_factor == 1.0:
        return dict(rope_type="default", rope_theta=config.rope_theta)
    return dict(rope_type="linear", rope_theta=config.rope_theta, factor=config.rope_scaling_factor)


def _family_requirements(family: Family, config: config_lib.MoEConfig) -> dict[str, Any]:
    """MoEConfig field -> the value ``family`` needs."""
    needs: dict[str, Any] = dict(
        scoring_func="softmax", n_group=1, topk_group=1, use_score_correction_bias=False,
        routed_scaling_factor=1.0,
    )  # fmt: skip
    if family.model_type == "mixtral":
        return needs | dict(
            qk_norm=False, qkv_bias=False, shared_width=0, norm_topk_prob=True,
            is_moe_layer=(True,) * config.num_layers,
        )  # fmt: skip
    if family.model_type == "qwen3_moe":
        return needs | dict(qk_norm=True, qkv_bias=False, shared_width=0)
    return needs | dict(qk_norm=False, shared_expert_gate=True, num_shared_experts=1)


def _check_expressible(family: Family, config: config_lib.MoEConfig) -> None:
    for name, wanted in _family_requirements(family, config).items():
        found = getattr(config, name)
        if found != wanted:
            raise ValueError(
                f"{family.model_type} cannot express MoEConfig.{name}={found!r} "
                f"(it needs {wanted!r})"
            )


FAMILIES = {
    family.model_type: family
    for family in (
        Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp",
               ("gate_proj", "up_proj", "down_proj"), _qwen3_moe_config),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", "mlp",
               ("gate_proj", "up_proj", "down_proj"), _qwen2_moe_config),
        Family("mixtral", "MixtralForCausalLM", "block_sparse_moe",
               ("w1", "w3", "w2"), _mixtral_config),
    )
}  # fmt: skip
"""The supported families by ``model_type``."""


def family_of(raw: dict) -> Family:
    """The family of a ``config.json``.

    Raises:
      ValueError: no ``model_type``, or one that is not supported.
    """
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (expected one of {sorted(FAMILIES)})"
        )
    return FAMILIES[model_type]


def family_for(config: config_lib.MoEConfig) -> Family:
    """The family that can express ``config`` (for saving a model built in jtbo).

    Raises:
      ValueError: none can; the message lists each family's reason.
    """
    reasons = []
    for family in FAMILIES.values():
        try:
            _check_expressible(family, config)
        except ValueError as error:
            reasons.append(str(error))
            continue
        return family
    raise ValueError("no supported family expresses this MoEConfig: " + "; ".join(reasons))
