"""Hugging Face ``config.json`` <-> ``MoEConfig`` for the supported model families.

Families: ``qwen3_moe`` (Qwen3-MoE: per-head q/k RMSNorm, no shared expert), ``qwen2_moe``
(Qwen1.5/2-MoE: q/k/v bias, one shared expert scaled per token by ``sigmoid(x @ w)``),
``mixtral``, and ``deepseek_v2`` / ``deepseek_v3`` (MLA attention, ``n_shared_experts`` shared
experts, ``first_k_dense_replace`` dense layers, DeepSeek's ``topk_method`` and
``routed_scaling_factor``, V3's ``e_score_correction_bias``, YaRN RoPE; FP8 block-quantized
weights (``quantization_config.quant_method: fp8``) are dequantized while loading,
``jtbo.models.hf.fp8``). The first three
route with a softmax top-k; Qwen renormalises the chosen weights only with ``norm_topk_prob``,
Mixtral always. Qwen's ``decoder_sparse_step`` / ``mlp_only_layers``
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
from jtbo.models.hf import fp8

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


_YARN_KEYS = {
    "factor": "rope_scaling_factor",
    "original_max_position_embeddings": "rope_yarn_original_max_position",
    "beta_fast": "rope_yarn_beta_fast",
    "beta_slow": "rope_yarn_beta_slow",
    "mscale": "rope_yarn_mscale",
    "mscale_all_dim": "rope_yarn_mscale_all_dim",
}


def _rope(fields: _Fields, default_theta: float, allow_yarn: bool = False) -> dict:
    """The ``MoEConfig`` RoPE fields from either RoPE spelling (YaRN only where allowed)."""
    params = fields.get("rope_parameters", None)
    legacy_theta = fields.get("rope_theta", None)
    scaling = fields.get("rope_scaling", None)
    if params is None:
        params = dict(scaling or {})
        params.setdefault("rope_theta", default_theta if legacy_theta is None else legacy_theta)
    kind = params.get("rope_type", params.get("type", "default"))
    field = "rope_parameters" if fields.raw.get("rope_parameters") is not None else "rope_scaling"
    kinds = ("default", "linear", "yarn") if allow_yarn else ("default", "linear")
    if kind not in kinds:
        raise ValueError(
            f"unsupported config field {field}.rope_type={kind!r} (expected one of {list(kinds)})"
        )
    known = {"rope_type", "type", "rope_theta"} | {
        "default": set(), "linear": {"factor"}, "yarn": set(_YARN_KEYS) | {"truncate"}
    }[kind]  # fmt: skip
    extra = sorted(set(params) - known)
    if extra:
        raise ValueError(f"unsupported config field(s) {field}.{extra} for rope_type {kind!r}")
    if params.get("truncate", True) is not True:
        raise ValueError(f"unsupported config field {field}.truncate={params['truncate']!r}")
    out = dict(rope_theta=float(params.get("rope_theta", default_theta)))
    if kind == "linear":
        out.update(rope_scaling_factor=float(params["factor"]))
    if kind == "yarn":
        out.update(rope_scaling_type="yarn")
        for key, name in _YARN_KEYS.items():
            if params.get(key) is not None:
                out[name] = params[key]
    return out


def _layer_types(fields: _Fields) -> None:
    layer_types = fields.get("layer_types", None) or []
    others = sorted({kind for kind in layer_types if kind != "full_attention"})
    if others:
        raise ValueError(
            f"unsupported config field layer_types with {others} (expected only "
            "'full_attention'): sliding-window attention is not implemented"
        )


def _common(fields: _Fields, default_theta: float, allow_yarn: bool = False) -> dict:
    """The ``MoEConfig`` fields every family spells the same way."""
    fields.expect("hidden_act", ("silu",), "silu", "jtbo's MLPs are SwiGLU")
    heads = fields.get("num_attention_heads")
    hidden = fields.get("hidden_size")
    rope_fields = _rope(fields, default_theta, allow_yarn)
    _layer_types(fields)
    return dict(
        vocab_size=fields.get("vocab_size"),
        hidden_size=hidden,
        num_layers=fields.get("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=fields.get("num_key_value_heads", None) or heads,
        head_dim=fields.get("head_dim", None) or hidden // heads,
        **rope_fields,
        rms_norm_eps=fields.get("rms_norm_eps"),
        max_position_embeddings=fields.get("max_position_embeddings", None),
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


def _deepseek_common(fields: _Fields) -> dict:
    """What DeepSeek-V2 and -V3 share: MLA, shared experts, dense first layers."""
    common = _common(fields, 10000.0, allow_yarn=True)
    heads = common["num_attention_heads"]
    if common["num_key_value_heads"] != heads:
        raise ValueError(
            f"unsupported config field num_key_value_heads={common['num_key_value_heads']} "
            f"(expected num_attention_heads={heads}: MLA gives every head its key and value)"
        )
    quantization = fields.get("quantization_config", None)
    if quantization is not None:
        fp8.block_size(quantization)  # FP8 blocks are dequantized while loading; others raise
    fields.expect("attention_bias", (False,), False, "attention projection biases")
    fields.expect("moe_layer_freq", (1,), 1, "every layer past first_k_dense_replace is MoE")
    fields.expect("pretraining_tp", (1,), 1, "a training-time tensor-parallel split")
    for unused in ("ep_size", "aux_loss_alpha", "seq_aux", "num_nextn_predict_layers"):
        fields.get(unused, None)  # training-only, or the MTP module (its tensors are skipped)
    nope, rope_dim = fields.get("qk_nope_head_dim"), fields.get("qk_rope_head_dim")
    fields.expect("qk_head_dim", (None, nope + rope_dim), None, "nope + rope head dims")
    n_group = fields.get("n_group", None) or 1
    return dict(
        common,
        head_dim=rope_dim,
        attention_kind="mla",
        q_lora_rank=fields.get("q_lora_rank", None),
        kv_lora_rank=fields.get("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=fields.get("v_head_dim"),
        intermediate_size=fields.get("intermediate_size"),
        moe_intermediate_size=fields.get("moe_intermediate_size"),
        num_experts=fields.get("n_routed_experts"),
        num_shared_experts=fields.get("n_shared_experts", None) or 0,
        first_k_dense=fields.get("first_k_dense_replace", 0),
        n_group=n_group,
        topk_group=fields.get("topk_group", None) or n_group,
        routed_scaling_factor=float(fields.get("routed_scaling_factor", 1.0)),
    )


def _deepseek_v2_config(fields: _Fields) -> dict:
    fields.expect("mlp_bias", (False,), False, "MLP biases")
    fields.expect("scoring_func", ("softmax",), "softmax", "DeepSeek-V2 routes by softmax")
    method = fields.expect(
        "topk_method", ("greedy", "group_limited_greedy"), "greedy", "DeepSeek-V2's top-k rules"
    )
    return dict(
        _deepseek_common(fields),
        scoring_func="softmax",
        topk_method=method,
        use_score_correction_bias=False,
        norm_topk_prob=fields.get("norm_topk_prob", False),
    )


def _deepseek_v3_config(fields: _Fields) -> dict:
    fields.expect(
        "rope_interleave", (True,), True,
        "DeepSeek-V3's RoPE pairs are interleaved; the loader permutes them",
    )  # fmt: skip
    fields.expect("scoring_func", ("sigmoid",), "sigmoid", "DeepSeek-V3 routes by sigmoid")
    fields.expect("topk_method", ("noaux_tc",), "noaux_tc", "DeepSeek-V3's top-k rule")
    return dict(
        _deepseek_common(fields),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        use_score_correction_bias=True,
        norm_topk_prob=fields.get("norm_topk_prob", True),
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
      shared_prefix: the shared-expert MLP's name inside the MoE block.
    """

    model_type: str
    architecture: str
    moe_prefix: str
    expert_projections: tuple[str, str, str]
    read_config: Callable[[_Fields], dict]
    shared_prefix: str = "shared_expert"

    @property
    def is_deepseek(self) -> bool:
        """DeepSeek-V2/V3: MLA attention, ``shared_experts``, the MTP module to skip."""
        return self.model_type in ("deepseek_v2", "deepseek_v3")

    def skipped_tensor(self, name: str, raw: dict) -> bool:
        """Whether a checkpoint tensor is deliberately not loaded: DeepSeek-V3's multi-token
        prediction module (``num_nextn_predict_layers`` layers past the decoder's, used only
        for speculative drafting)."""
        extra = raw.get("num_nextn_predict_layers") or 0
        if not self.is_deepseek or not extra or not name.startswith("model.layers."):
            return False
        layer = int(name.split(".")[2])
        return raw["num_hidden_layers"] <= layer < raw["num_hidden_layers"] + extra

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
        if config.max_position_embeddings is not None:
            raw["max_position_embeddings"] = config.max_position_embeddings
        if self.is_deepseek:
            return _deepseek_hf_config(self, config, raw)
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
    if config.rope_scaling_type == "yarn":
        out = dict(rope_type="yarn", rope_theta=config.rope_theta)
        out.update({key: getattr(config, name) for key, name in _YARN_KEYS.items()})
        return {key: value for key, value in out.items() if value != 0.0}
    return dict(rope_type="linear", rope_theta=config.rope_theta, factor=config.rope_scaling_factor)


def _deepseek_hf_config(family: Family, config: config_lib.MoEConfig, raw: dict) -> dict:
    raw.update(
        num_key_value_heads=config.num_attention_heads, head_dim=config.qk_rope_head_dim,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim, intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size, n_routed_experts=config.num_experts,
        n_shared_experts=config.num_shared_experts, first_k_dense_replace=config.first_k_dense,
        n_group=config.n_group, topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob, routed_scaling_factor=config.routed_scaling_factor,
        attention_bias=False,
    )  # fmt: skip
    if family.model_type == "deepseek_v2":
        raw.update(topk_method=config.router_topk_method, mlp_bias=False)
    else:
        raw.update(rope_interleave=True)
    return raw


def _family_requirements(family: Family, config: config_lib.MoEConfig) -> dict[str, Any]:
    """MoEConfig field -> the value ``family`` needs."""
    if family.model_type == "deepseek_v2":
        return dict(
            attention_kind="mla", scoring_func="softmax", use_score_correction_bias=False,
            shared_expert_gate=False, shared_expert_intermediate_size=None,
            is_moe_layer=_deepseek_layers(config),
        )  # fmt: skip
    if family.model_type == "deepseek_v3":
        return dict(
            attention_kind="mla", scoring_func="sigmoid", router_topk_method="noaux_tc",
            use_score_correction_bias=True, shared_expert_gate=False,
            shared_expert_intermediate_size=None, is_moe_layer=_deepseek_layers(config),
        )  # fmt: skip
    needs: dict[str, Any] = dict(
        attention_kind="gqa", scoring_func="softmax", n_group=1, topk_group=1,
        use_score_correction_bias=False, routed_scaling_factor=1.0,
    )  # fmt: skip
    if family.model_type == "mixtral":
        return needs | dict(
            qk_norm=False, qkv_bias=False, shared_width=0, norm_topk_prob=True,
            is_moe_layer=(True,) * config.num_layers,
        )  # fmt: skip
    if family.model_type == "qwen3_moe":
        return needs | dict(qk_norm=True, qkv_bias=False, shared_width=0)
    return needs | dict(qk_norm=False, shared_expert_gate=True, num_shared_experts=1)


def _deepseek_layers(config: config_lib.MoEConfig) -> tuple[bool, ...]:
    """DeepSeek's layer kinds: dense before ``first_k_dense_replace``, MoE after."""
    return tuple(i >= config.first_k_dense for i in range(config.num_layers))


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
        Family("deepseek_v2", "DeepseekV2ForCausalLM", "mlp",
               ("gate_proj", "up_proj", "down_proj"), _deepseek_v2_config, "shared_experts"),
        Family("deepseek_v3", "DeepseekV3ForCausalLM", "mlp",
               ("gate_proj", "up_proj", "down_proj"), _deepseek_v3_config, "shared_experts"),
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
