"""Model configuration: one frozen, typed dataclass describing a DeepSeek/Qwen-style MoE model.

Every field carries a description in its ``metadata`` (``describe()`` lists them). Presets:
``MoEConfig.tiny()`` (tests, demo: shapes that divide evenly over 8 devices in any of the
layouts (dp, attn_tp) in {(8, 1), (4, 2), (2, 4)}) and ``MoEConfig.deepseek_v3_reduced()``
(the benchmark: DeepSeek-V3's hidden size, expert shape and MLA attention, fewer experts and
layers so that it fits on one H200) and ``MoEConfig.deepseek_v3()`` (the full model, for the
step model and AOT compiles only); ``tiny_softmax`` / ``tiny_mla`` and
``deepseek_v3_gqa_reduced`` vary them (Qwen-style routing; DeepSeek's MLA attention; GQA in
place of MLA).
"""

import dataclasses
from typing import Literal


def _field(default, description: str):
    return dataclasses.field(default=default, metadata=dict(description=description))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shapes and numerics of the MoE model (see each field's description)."""

    vocab_size: int = _field(128, "number of token ids; embedding rows and LM-head columns")
    hidden_size: int = _field(64, "width of the residual stream")
    num_layers: int = _field(3, "decoder layers")
    num_attention_heads: int = _field(8, "query heads")
    num_key_value_heads: int = _field(4, "key/value heads (GQA: query heads share them)")
    head_dim: int = _field(8, "width of one attention head")
    rope_theta: float = _field(10000.0, "RoPE base frequency")
    rope_scaling_factor: float = _field(
        1.0, "linear RoPE scaling: positions are divided by it (Hugging Face rope_type 'linear')"
    )
    rope_scaling_type: Literal["linear", "yarn"] = _field(
        "linear",
        "how rope_scaling_factor applies: 'linear' divides positions; 'yarn' blends "
        "interpolated and extrapolated frequencies (DeepSeek's YaRN; the rope_yarn_* fields)",
    )
    rope_yarn_original_max_position: int = _field(
        4096, "YaRN: the context length the model was pre-trained at"
    )
    rope_yarn_beta_fast: float = _field(32.0, "YaRN: rotations where interpolation ends")
    rope_yarn_beta_slow: float = _field(1.0, "YaRN: rotations where interpolation begins")
    rope_yarn_mscale: float = _field(
        0.0, "YaRN: mscale of the rotated dims (0: unset, as a missing config field)"
    )
    rope_yarn_mscale_all_dim: float = _field(
        0.0, "YaRN: mscale of the softmax scale, applied squared (0: unset)"
    )
    max_position_embeddings: int | None = _field(
        None,
        "positions the model was trained for (Hugging Face max_position_embeddings): the "
        "runner's default longest context; None: no bound of the model's own",
    )
    rms_norm_eps: float = _field(1e-6, "epsilon inside every RMSNorm")
    first_k_dense: int = _field(1, "the first k layers use a dense MLP instead of the MoE")
    decoder_sparse_step: int = _field(
        1, "past first_k_dense, layer i is a MoE layer only where (i + 1) % step == 0 (Qwen-MoE)"
    )
    mlp_only_layers: tuple[int, ...] = _field((), "layers that use a dense MLP (Qwen-MoE)")
    intermediate_size: int = _field(96, "hidden width of the dense MLP layers")
    num_experts: int = _field(8, "routed experts per MoE layer")
    num_experts_per_tok: int = _field(2, "routed experts chosen per token (top-k)")
    moe_intermediate_size: int = _field(32, "hidden width of one routed expert")
    num_shared_experts: int = _field(1, "shared experts (0: none); they form one wider MLP")
    shared_expert_intermediate_size: int | None = _field(
        None, "hidden width of the shared-expert MLP; None: num_shared_experts * moe width"
    )
    shared_expert_gate: bool = _field(
        False, "scale the shared experts' output per token by sigmoid(x @ w) (Qwen2-MoE)"
    )
    scoring_func: Literal["softmax", "sigmoid"] = _field(
        "sigmoid", "router scores: softmax (Qwen-style) or sigmoid (DeepSeek-V3)"
    )
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] | None = _field(
        None,
        "expert choice (DeepSeek's topk_method): 'greedy' plain top-k; 'group_limited_greedy' "
        "keeps the topk_group groups with the best single score (V2); 'noaux_tc' keeps those "
        "with the best two biased scores (V3); None: greedy for softmax, noaux_tc for sigmoid",
    )
    n_group: int = _field(4, "expert groups for grouped top-k (1: plain top-k)")
    topk_group: int = _field(2, "groups kept per token by grouped top-k")
    use_score_correction_bias: bool = _field(
        True, "add a learned per-expert bias to the scores when choosing (not weighting) experts"
    )
    norm_topk_prob: bool = _field(True, "renormalise the chosen experts' weights to sum to 1")
    routed_scaling_factor: float = _field(1.0, "multiplier on the routed experts' weights")
    tie_word_embeddings: bool = _field(False, "LM head reuses the embedding matrix")
    qk_norm: bool = _field(False, "per-head RMSNorm of queries and keys before RoPE (Qwen3)")
    qkv_bias: bool = _field(False, "a learned bias on the query, key and value projections")
    attention_kind: Literal["gqa", "mla"] = _field(
        "gqa",
        "'gqa': fused Q/K/V heads (num_key_value_heads, head_dim); 'mla': DeepSeek's multi-head "
        "latent attention (the q_lora_rank .. v_head_dim fields; a latent KV cache)",
    )
    q_lora_rank: int | None = _field(
        None, "MLA: rank of the low-rank query projection (None: one full projection, V2-Lite)"
    )
    kv_lora_rank: int = _field(16, "MLA: width of the compressed KV latent")
    qk_nope_head_dim: int = _field(8, "MLA: query/key head dims without RoPE")
    qk_rope_head_dim: int = _field(4, "MLA: query/key head dims with RoPE (key shared by heads)")
    v_head_dim: int = _field(8, "MLA: value head width")
    expert_dtype: str | None = _field(
        None,
        "how the routed experts' weights are stored: None, as the other parameters (in the "
        "model's dtype); 'float8_e4m3fn', block-scaled FP8, float8_e4m3fn values and a "
        "float32 scale per expert_block_size block (jtbo.kernels.fp8_blocks), which "
        "jtbo.models.cast leaves FP8",
    )
    expert_block_size: tuple[int, int] = _field(
        (128, 128),
        "FP8 experts: the (contraction, output) block sharing one scale in each expert's "
        "matrices (DeepSeek-V3's weight_block_size)",
    )
    expert_fp8_activations: bool = _field(
        True,
        "FP8 experts: whether the expert FFN quantizes its rows too, each token's "
        "expert_block_size[0] channels to FP8 with their own scale, and multiplies in FP8 "
        "(DeepSeek-V3's inference scheme); False: weight-only FP8, the rows stay in the "
        "model's dtype (jtbo.kernels.grouped_gemm)",
    )

    def __post_init__(self):
        _check_positive(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} > num_experts={self.num_experts}"
            )
        _check_groups(self)
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ValueError(f"first_k_dense={self.first_k_dense} not in [0, {self.num_layers}]")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func={self.scoring_func!r}: expected softmax or sigmoid")
        if self.topk_method not in (None, "greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(
                f"topk_method={self.topk_method!r}: expected None, 'greedy', "
                "'group_limited_greedy' or 'noaux_tc'"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        _check_attention_kind(self)
        _check_rope_scaling(self)
        _check_layer_kinds(self)
        _check_expert_storage(self)
        if self.shared_expert_gate and not self.shared_width:
            raise ValueError("shared_expert_gate=True needs shared experts (num_shared_experts=0)")

    @property
    def is_moe_layer(self) -> tuple[bool, ...]:
        """Per layer: True for a MoE layer, False for a dense-MLP layer."""
        return tuple(
            i >= self.first_k_dense
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

    @property
    def router_topk_method(self) -> str:
        """``topk_method``, with None resolved by ``scoring_func``."""
        if self.topk_method is not None:
            return self.topk_method
        return "greedy" if self.scoring_func == "softmax" else "noaux_tc"

    @property
    def qk_head_dim(self) -> int:
        """MLA: query/key head width, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_pool_heads(self, attn_tp_size: int) -> tuple[int, int, int]:
        """The KV pool's per-token layout over one DP rank: ``(heads, key width, value width)``.

        GQA stores ``num_key_value_heads`` heads of ``head_dim`` keys and values, split over
        ``attn_tp``. MLA stores one latent row of ``kv_lora_rank + qk_rope_head_dim`` as its
        key and no value pool (value width 0: the values are the latent's first
        ``kv_lora_rank`` columns); every ``attn_tp`` rank needs the whole latent, so the pool
        holds one copy per rank (``attn_tp_size`` heads, one per rank after the split).

        Args:
          attn_tp_size: devices per DP rank.

        Returns:
          ``(heads, key width, value width)`` of the pool before the ``attn_tp`` split.
        """
        if self.attention_kind == "mla":
            return attn_tp_size, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.num_key_value_heads, self.head_dim, self.head_dim

    @property
    def shared_width(self) -> int:
        """Hidden width of the shared-expert MLP (0: no shared experts)."""
        if not self.num_shared_experts:
            return 0
        if self.shared_expert_intermediate_size is not None:
            return self.shared_expert_intermediate_size
        return self.num_shared_experts * self.moe_intermediate_size

    @classmethod
    def tiny(cls) -> "MoEConfig":
        """A few-thousand-parameter model for tests and the demo (the defaults)."""
        return cls()

    @classmethod
    def tiny_softmax(cls) -> "MoEConfig":
        """``tiny`` with a Qwen3-style router: softmax top-k, no groups, no shared experts."""
        return cls(
            scoring_func="softmax",
            n_group=1,
            topk_group=1,
            use_score_correction_bias=False,
            num_shared_experts=0,
        )

    @classmethod
    def tiny_mla(cls) -> "MoEConfig":
        """``tiny`` with DeepSeek's MLA attention (low-rank queries), YaRN RoPE and 2 layers
        (one dense, one MoE: fewer compiled layers for the end-to-end tests)."""
        return cls(
            num_layers=2,
            num_key_value_heads=8,  # MLA leaves the GQA fields unused; these are what a
            head_dim=4,  # DeepSeek config.json implies, so a save / load round trip is exact
            topk_method="noaux_tc",
            attention_kind="mla",
            q_lora_rank=12,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            rope_scaling_type="yarn",
            rope_scaling_factor=4.0,
            rope_yarn_original_max_position=16,
            rope_yarn_mscale=0.9,
            rope_yarn_mscale_all_dim=0.7,
        )

    @classmethod
    def deepseek_v3_gqa_reduced(cls) -> "MoEConfig":
        """DeepSeek-V3's hidden size and routed-expert shape, 64 experts and 4 layers, with GQA.

        Attention is GQA (DeepSeek-V3 uses MLA: ``deepseek_v3_reduced``) with 56 heads of 128
        so that the projection widths match the hidden size; its KV cache holds
        ``2 x 8 x 128 = 2048`` values per token and layer.
        """
        return cls(
            vocab_size=32768,
            hidden_size=7168,
            num_layers=4,
            num_attention_heads=56,
            num_key_value_heads=8,
            head_dim=128,
            first_k_dense=1,
            intermediate_size=18432,
            num_experts=64,
            num_experts_per_tok=8,
            moe_intermediate_size=2048,
            num_shared_experts=1,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
        )

    @classmethod
    def deepseek_v3_reduced(cls) -> "MoEConfig":
        """DeepSeek-V3 reduced to fit one H200: its hidden size, routed-expert shape and MLA
        attention, with 64 experts and 4 layers (the benchmark model).

        MLA with V3's dimensions: 128 heads, ``q_lora_rank`` 1536, ``kv_lora_rank`` 512,
        ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128, and V3's YaRN
        RoPE (factor 40 over 4096 pre-training positions, mscale 1). The KV cache holds 576
        values per token and layer where the GQA variant (``deepseek_v3_gqa_reduced``) holds
        2048.
        """
        return dataclasses.replace(
            cls.deepseek_v3_gqa_reduced(),
            num_attention_heads=128,
            num_key_value_heads=128,
            attention_kind="mla",
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            rope_scaling_type="yarn",
            rope_scaling_factor=40.0,
            rope_yarn_original_max_position=4096,
            rope_yarn_mscale=1.0,
            rope_yarn_mscale_all_dim=1.0,
        )

    @classmethod
    def deepseek_v3(cls) -> "MoEConfig":
        """DeepSeek-V3's full published dimensions: 61 layers (the first 3 dense), 256 routed
        experts of width 2048 (top-8 in 4 of 8 groups) and one shared expert, MLA attention.

        For the TBO step model and AOT compiles; its weights do not
        fit one machine of a few GPUs.
        """
        return dataclasses.replace(
            cls.deepseek_v3_reduced(),
            vocab_size=129280,
            num_layers=61,
            first_k_dense=3,
            num_experts=256,
            max_position_embeddings=163840,
        )

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Returns field name -> description."""
        return {f.name: f.metadata["description"] for f in dataclasses.fields(cls)}


_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_group",
    "topk_group",
)


def _check_positive(config: MoEConfig) -> None:
    for name in _POSITIVE:
        if getattr(config, name) <= 0:
            raise ValueError(f"{name}={getattr(config, name)} must be positive")
    if config.num_shared_experts < 0:
        raise ValueError(f"num_shared_experts={config.num_shared_experts} must be >= 0")
    if config.shared_expert_intermediate_size is not None and (
        config.shared_expert_intermediate_size <= 0
    ):
        raise ValueError(
            f"shared_expert_intermediate_size={config.shared_expert_intermediate_size} must be "
            "positive (None: num_shared_experts * moe_intermediate_size)"
        )
    if config.rope_scaling_factor <= 0:
        raise ValueError(f"rope_scaling_factor={config.rope_scaling_factor} must be positive")


def _check_attention_kind(config: MoEConfig) -> None:
    if config.attention_kind not in ("gqa", "mla"):
        raise ValueError(f"attention_kind={config.attention_kind!r}: expected 'gqa' or 'mla'")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(config, name) <= 0:
            raise ValueError(f"{name}={getattr(config, name)} must be positive")
    if config.q_lora_rank is not None and config.q_lora_rank <= 0:
        raise ValueError(f"q_lora_rank={config.q_lora_rank} must be positive or None")
    if config.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={config.qk_rope_head_dim} must be even for RoPE")
    if config.attention_kind == "mla" and (config.qk_norm or config.qkv_bias):
        raise ValueError(
            f"attention_kind='mla' has no qk_norm / qkv_bias (found qk_norm={config.qk_norm}, "
            f"qkv_bias={config.qkv_bias})"
        )


def _check_rope_scaling(config: MoEConfig) -> None:
    if config.rope_scaling_type not in ("linear", "yarn"):
        raise ValueError(
            f"rope_scaling_type={config.rope_scaling_type!r}: expected 'linear' or 'yarn'"
        )
    if config.rope_yarn_original_max_position <= 0:
        raise ValueError(
            f"rope_yarn_original_max_position={config.rope_yarn_original_max_position} "
            "must be positive"
        )


def _check_layer_kinds(config: MoEConfig) -> None:
    if config.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={config.decoder_sparse_step} must be >= 1")
    if not isinstance(config.mlp_only_layers, tuple):
        raise ValueError(f"mlp_only_layers={config.mlp_only_layers!r} must be a tuple")
    outside = [i for i in config.mlp_only_layers if not 0 <= i < config.num_layers]
    if outside:
        raise ValueError(f"mlp_only_layers {outside} outside [0, {config.num_layers})")


EXPERT_DTYPES = (None, "float8_e4m3fn")
"""``MoEConfig.expert_dtype`` choices."""


def resolve_expert_dtype(expert_dtype: str | None, dtype_name: str) -> str | None:
    """The ``MoEConfig.expert_dtype`` of a request for experts stored as ``expert_dtype`` in
    a model served in ``dtype_name``.

    Args:
      expert_dtype: None or ``dtype_name`` (the experts as the other parameters), or
        ``"float8_e4m3fn"``.
      dtype_name: the serving dtype's name, e.g. ``"bfloat16"``.

    Returns:
      None or ``"float8_e4m3fn"``.

    Raises:
      ValueError: any other ``expert_dtype`` (names the choices).
    """
    if expert_dtype is None or expert_dtype == dtype_name:
        return None
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(
            f"expert_dtype={expert_dtype!r}: expected None, {dtype_name!r} (the parameters' "
            f"dtype) or {EXPERT_DTYPES[1]!r}"
        )
    return expert_dtype


def _check_expert_storage(config: MoEConfig) -> None:
    if config.expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype={config.expert_dtype!r}: expected one of {EXPERT_DTYPES}")
    block = config.expert_block_size
    if (
        not (
            isinstance(block, tuple) and len(block) == 2 and all(isinstance(b, int) for b in block)
        )
        or min(block) < 1
    ):
        raise ValueError(f"expert_block_size={block!r} must be a tuple of two positive ints")


def _check_groups(config: MoEConfig) -> None:
    if config.num_experts % config.n_group:
        raise ValueError(
            f"num_experts={config.num_experts} is not a multiple of n_group={config.n_group}"
        )
    if config.topk_group > config.n_group:
        raise ValueError(f"topk_group={config.topk_group} > n_group={config.n_group}")
    per_group = config.num_experts // config.n_group
    if config.router_topk_method == "noaux_tc" and config.n_group > 1 and per_group < 2:
        raise ValueError(
            f"grouped top-k scores a group by its best 2 experts; num_experts/n_group={per_group}"
        )
    if config.num_experts_per_tok > config.topk_group * per_group:
        raise ValueError(
            f"num_experts_per_tok={config.num_experts_per_tok} > experts in the kept groups "
            f"({config.topk_group} * {per_group})"
        )
