"""Which Hugging Face tensors make each ``MoEModel`` parameter, and how.

jtbo fuses what transformers keeps apart (``jtbo.models.self_attention`` and ``mlp`` say
why): ``wqkv [H, kv_heads, group + 2, D]`` holds, per KV head, its query heads, then its key
and value rows of ``q_proj`` / ``k_proj`` / ``v_proj`` (torch ``Linear`` weights are
``[out, in]``); ``w_gate_up [.., H, 2, F]`` stacks ``gate`` and ``up``; matrices are stored
``[in, out]``; routed experts are stacked on a leading expert axis. Each ``Recipe`` names the
checkpoint tensors of one parameter with their expected shapes, and the two pure maps between
them. Both maps only transpose, reshape, stack and split, so a round trip is exact.

Routed-expert recipes are per expert (``per_expert`` tensors each, expert-major), so a device
that holds some experts reads only theirs (``placement``). FP8 routed experts keep each
matrix ``[out, in]`` instead (contraction-last, ``jtbo.kernels.fp8_blocks.expert_axes``):
``out_in_expert_recipes`` only stacks them.
"""

import dataclasses
from collections.abc import Callable

import numpy as np

from jtbo.models import config as config_lib
from jtbo.models.hf import families

Path = tuple  # a parameter's path in the model's nnx state, e.g. ("layers", 0, "attn", "wqkv")
Arrays = list[np.ndarray]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one ``MoEModel`` parameter is made from checkpoint tensors and back.

    Attributes:
      path: the parameter's path in the model's state.
      sources: checkpoint tensor names (for expert recipes, ``per_expert`` per expert, in
        expert order).
      source_shapes: the expected shape of each source.
      to_jtbo: sources (one expert's, for expert recipes) -> the parameter (one expert's row).
      to_hf: the parameter (one expert's row) -> its sources.
      per_expert: 0, or how many sources each expert has.
    """

    path: Path
    sources: tuple[str, ...]
    source_shapes: tuple[tuple[int, ...], ...]
    to_jtbo: Callable[[Arrays], np.ndarray]
    to_hf: Callable[[np.ndarray], Arrays]
    per_expert: int = 0

    def expert_sources(self, expert: int) -> tuple[str, ...]:
        """The source names of one expert (expert recipes only)."""
        return self.sources[expert * self.per_expert : (expert + 1) * self.per_expert]


def _same(path, name, shape) -> Recipe:
    return Recipe(path, (name,), (shape,), lambda t: t[0], lambda a: [a])


def _transposed(path, name, shape) -> Recipe:
    return Recipe(path, (name,), (shape,), lambda t: t[0].T, lambda a: [a.T])


def _gate_up(hidden: int, width: int) -> tuple:
    """(to_jtbo, to_hf, shapes) of a gate/up pair of ``[F, H]`` weights <-> ``[H, 2, F]``."""
    return (
        lambda t: np.stack([t[0].T, t[1].T], axis=1),
        lambda a: [a[:, 0].T, a[:, 1].T],
        ((width, hidden), (width, hidden)),
    )


def _mlp(path: Path, prefix: str, names: tuple[str, str, str], hidden: int, width: int):
    """The ``w_gate_up`` and ``w_down`` recipes of one SwiGLU MLP."""
    gate, up, down = (f"{prefix}.{name}.weight" for name in names)
    to_jtbo, to_hf, shapes = _gate_up(hidden, width)
    return [
        Recipe((*path, "w_gate_up"), (gate, up), shapes, to_jtbo, to_hf),
        _transposed((*path, "w_down"), down, (hidden, width)),
    ]


def _attention(config: config_lib.MoEConfig, layer: int) -> list[Recipe]:
    prefix, path = f"model.layers.{layer}.self_attn", ("layers", layer, "attn")
    h, d = config.hidden_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    group = nq // nkv
    names = tuple(f"{prefix}.{p}_proj.weight" for p in "qkv")

    def qkv_to_jtbo(t):
        q, k, v = (x.reshape(nkv, -1, d, h) for x in t)
        return np.concatenate([q, k, v], axis=1).transpose(3, 0, 1, 2)

    def qkv_to_hf(a):
        per_head = a.transpose(1, 2, 3, 0)  # [kv_heads, group + 2, D, H]
        return [per_head[:, :group].reshape(nq * d, h)] + [
            per_head[:, i].reshape(nkv * d, h) for i in (group, group + 1)
        ]

    shapes = ((nq * d, h), (nkv * d, h), (nkv * d, h))
    recipes = [
        Recipe((*path, "wqkv"), names, shapes, qkv_to_jtbo, qkv_to_hf),
        Recipe(
            (*path, "wo"), (f"{prefix}.o_proj.weight",), ((h, nq * d),),
            lambda t: t[0].T.reshape(nq, d, h), lambda a: [a.reshape(nq * d, h).T],
        ),
    ]  # fmt: skip
    if config.qkv_bias:
        bias_names = tuple(f"{prefix}.{p}_proj.bias" for p in "qkv")
        recipes.append(
            Recipe(
                (*path, "bqkv"), bias_names, ((nq * d,), (nkv * d,), (nkv * d,)),
                lambda t: np.concatenate([x.reshape(nkv, -1, d) for x in t], axis=1),
                lambda a: [a[:, :group].reshape(-1), a[:, group].reshape(-1),
                           a[:, group + 1].reshape(-1)],
            )
        )  # fmt: skip
    if config.qk_norm:
        for which in ("q_norm", "k_norm"):
            recipes.append(_same((*path, which, "weight"), f"{prefix}.{which}.weight", (d,)))
    return recipes


def _rope_half_order(rope_dim: int) -> np.ndarray:
    """Column order taking DeepSeek's interleaved RoPE pairs ``(x0, x1), (x2, x3), ..`` to
    jtbo's half layout ``(x0, x2, .., x1, x3, ..)``; scores do not change when queries and
    keys are permuted alike (``jtbo.models.mla_attention``)."""
    return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


def _mla_attention(config: config_lib.MoEConfig, layer: int) -> list[Recipe]:
    """MLA projections; the rotated columns of the query and the latent key are permuted."""
    prefix, path = f"model.layers.{layer}.self_attn", ("layers", layer, "attn")
    h, heads, rank = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
    nope, rope_dim, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    qk = nope + rope_dim
    order = _rope_half_order(rope_dim)
    q_order = np.concatenate([np.arange(nope), nope + order])
    q_back, kv_back = (
        np.argsort(q_order),
        np.argsort(np.concatenate([np.arange(rank), rank + order])),
    )
    kv_order = np.argsort(kv_back)

    def heads_recipe(name, param, fan_in):  # [heads * qk, in] <-> [in, heads, qk]
        return Recipe(
            (*path, param), (f"{prefix}.{name}.weight",), ((heads * qk, fan_in),),
            lambda t: t[0].T.reshape(fan_in, heads, qk)[..., q_order],
            lambda a: [a[..., q_back].reshape(fan_in, heads * qk).T],
        )  # fmt: skip

    recipes = [
        Recipe(
            (*path, "wkv_a"), (f"{prefix}.kv_a_proj_with_mqa.weight",), ((rank + rope_dim, h),),
            lambda t: t[0].T[:, kv_order], lambda a: [a[:, kv_back].T],
        ),
        _same((*path, "kv_a_norm", "weight"), f"{prefix}.kv_a_layernorm.weight", (rank,)),
        Recipe(
            (*path, "wkv_b"), (f"{prefix}.kv_b_proj.weight",), ((heads * (nope + v), rank),),
            lambda t: t[0].T.reshape(rank, heads, nope + v),
            lambda a: [a.reshape(rank, heads * (nope + v)).T],
        ),
        Recipe(
            (*path, "wo"), (f"{prefix}.o_proj.weight",), ((h, heads * v),),
            lambda t: t[0].T.reshape(heads, v, h), lambda a: [a.reshape(heads * v, h).T],
        ),
    ]  # fmt: skip
    if config.q_lora_rank is None:
        return recipes + [heads_recipe("q_proj", "wq", h)]
    q_rank = config.q_lora_rank
    return recipes + [
        _transposed((*path, "wq_a"), f"{prefix}.q_a_proj.weight", (q_rank, h)),
        _same((*path, "q_a_norm", "weight"), f"{prefix}.q_a_layernorm.weight", (q_rank,)),
        heads_recipe("q_b_proj", "wq_b", q_rank),
    ]


def _experts(
    config: config_lib.MoEConfig, family: families.Family, layer: int, *, out_in: bool = False
) -> list[Recipe]:
    """The routed experts' ``w_gate_up [E, H, 2, F]`` and ``w_down [E, F, H]`` recipes; with
    ``out_in``, each expert's matrices kept ``[out, in]`` as the checkpoint stores them
    (stacked, never transposed): ``[E, 2, F, H]`` and ``[E, H, F]``."""
    prefix = f"model.layers.{layer}.{family.moe_prefix}.experts"
    path = ("layers", layer, "moe", "experts")
    h, f, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    gate, up, down = family.expert_projections
    gate_up_names = tuple(f"{prefix}.{i}.{name}.weight" for i in range(e) for name in (gate, up))
    down_names = tuple(f"{prefix}.{i}.{down}.weight" for i in range(e))
    if out_in:
        gate_up_maps = (np.stack, lambda a: [a[0], a[1]])  # [F, H] twice <-> [2, F, H]
        down_maps = (lambda t: t[0], lambda a: [a])  # [H, F] as it is
    else:
        gate_up_maps = _gate_up(h, f)[:2]  # [F, H] twice <-> [H, 2, F]
        down_maps = (lambda t: t[0].T, lambda a: [a.T])  # [H, F] <-> [F, H]
    return [
        Recipe((*path, "w_gate_up"), gate_up_names, ((f, h),) * 2 * e, *gate_up_maps,
               per_expert=2),
        Recipe((*path, "w_down"), down_names, ((h, f),) * e, *down_maps, per_expert=1),
    ]  # fmt: skip


def out_in_expert_recipes(config: config_lib.MoEConfig, family: families.Family) -> list[Recipe]:
    """The routed experts' recipes with each expert's matrices kept ``[out, in]``:
    ``w_gate_up`` as ``[E, 2, F, H]`` (gate at index 0, up at 1), ``w_down`` as ``[E, H, F]``.

    This is ``recipes``' parameters with their contraction axis moved last, the order FP8
    experts store theirs in (``jtbo.kernels.fp8_blocks.expert_axes``), made without a
    transpose.

    Args:
      config: the model's config.
      family: the checkpoint family.

    Returns:
      Two recipes per MoE layer, with the paths, sources and source shapes of ``recipes``'.
    """
    return [
        recipe
        for layer, moe in enumerate(config.is_moe_layer)
        if moe
        for recipe in _experts(config, family, layer, out_in=True)
    ]


def _moe(config: config_lib.MoEConfig, family: families.Family, layer: int) -> list[Recipe]:
    prefix, path = f"model.layers.{layer}.{family.moe_prefix}", ("layers", layer, "moe")
    h = config.hidden_size
    recipes = [
        _transposed((*path, "router", "weight"), f"{prefix}.gate.weight", (config.num_experts, h)),
        *_experts(config, family, layer),
    ]
    if config.use_score_correction_bias:
        bias_name = f"{prefix}.gate.e_score_correction_bias"
        recipes.append(
            _same((*path, "router", "correction_bias"), bias_name, (config.num_experts,))
        )
    if config.shared_width:
        names = ("gate_proj", "up_proj", "down_proj")
        shared_prefix = f"{prefix}.{family.shared_prefix}"
        recipes += _mlp((*path, "shared"), shared_prefix, names, h, config.shared_width)
    if config.shared_expert_gate:
        recipes.append(
            Recipe(
                (*path, "shared_gate"), (f"{prefix}.shared_expert_gate.weight",), ((1, h),),
                lambda t: t[0][0], lambda a: [a[None]],
            )
        )  # fmt: skip
    return recipes


def _layer(config: config_lib.MoEConfig, family: families.Family, layer: int) -> list[Recipe]:
    prefix, path, h = f"model.layers.{layer}", ("layers", layer), config.hidden_size
    recipes = [
        _same((*path, "input_norm", "weight"), f"{prefix}.input_layernorm.weight", (h,)),
        _same(
            (*path, "post_attn_norm", "weight"), f"{prefix}.post_attention_layernorm.weight", (h,)
        ),
        *(_mla_attention if config.attention_kind == "mla" else _attention)(config, layer),
    ]
    if config.is_moe_layer[layer]:
        return recipes + _moe(config, family, layer)
    names = ("gate_proj", "up_proj", "down_proj")
    return recipes + _mlp((*path, "mlp"), f"{prefix}.mlp", names, h, config.intermediate_size)


def recipes(config: config_lib.MoEConfig, family: families.Family) -> list[Recipe]:
    """Every parameter's recipe for a model of ``config`` in ``family``'s layout.

    Args:
      config: the model's config.
      family: the checkpoint family (tensor names of the MoE block and its experts).

    Returns:
      One recipe per parameter of ``MoEModel(config)``.
    """
    v, h = config.vocab_size, config.hidden_size
    out = [
        _same(("embed", "table"), "model.embed_tokens.weight", (v, h)),
        _same(("final_norm", "weight"), "model.norm.weight", (h,)),
    ]
    if not config.tie_word_embeddings:
        out.append(_transposed(("lm_head", "weight"), "lm_head.weight", (v, h)))
    for layer in range(config.num_layers):
        out += _layer(config, family, layer)
    return out
