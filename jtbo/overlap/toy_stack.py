"""A DeepSeek-like MoE layer stack written as operations, for overlap reports and tests.

Each layer: pre-norm residual add, a per-token attention stand-in (QKV matmul, a
position-dependent rotation, a gated product, output projection), a router with top-k
selection, routed experts sharded over the ``dp`` mesh axis, optional shared experts. The
routed experts come in two communication variants, both split into ``*_a`` (issue the
collective, result marked ``InFlight``) and ``*_b`` (consume it) operations:

- ``"ep"``: expert parallelism. Each token's top-k choices are written into a dense
  capacity buffer ``[experts, capacity, hidden]`` (slot = the choice's rank among this
  rank's choices of that expert; choices past ``capacity`` are dropped), exchanged with a
  dense ``lax.all_to_all`` (dispatch), run through the local experts, exchanged back
  (combine) and summed with the routing weights.
- ``"dp"``: DP attention with a dense TP-MoE. The routing weights ride along the hidden
  states in one DP all-gather (dispatch); every rank runs its expert slice on all DP ranks'
  tokens and a reduce-scatter sums the partial outputs back to each rank's tokens (combine).

The attention stand-in is per token, so a token's output does not depend on which
micro-batch it is in: the TBO and plain forwards agree up to float rounding (with
``capacity`` large enough that nothing is dropped).
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jtbo.collectives import mesh as mesh_lib
from jtbo.collectives import rows as rows_lib
from jtbo.overlap import layer_loop, operations, strategy

DP_AXIS = mesh_lib.DP_AXIS


@dataclasses.dataclass(frozen=True)
class ToyStackConfig:
    """Sizes and variant of the toy stack."""

    num_layers: int = 2  # decoder layers
    hidden_size: int = 256  # model width
    moe_intermediate_size: int = 512  # expert (and shared expert) FFN width
    num_experts: int = 16  # routed experts in total (split over the dp axis)
    top_k: int = 2  # experts per token
    moe: str = "ep"  # "ep": all-to-all dispatch/combine; "dp": all-gather / reduce-scatter
    shared_experts: bool = True  # DeepSeek (True) or Qwen3-style MoE without them (False)
    capacity: int | None = None  # EP slots per expert and source rank; None: tokens (no drop)
    dtype: Any = jnp.float32  # weights and activations

    def __post_init__(self):
        if self.moe not in ("ep", "dp"):
            raise ValueError(f"moe must be 'ep' or 'dp', got {self.moe!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} outside [1, num_experts={self.num_experts}]")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ToyLayerWeights:
    """One layer's weights (global shapes; experts split over ``dp`` on axis 0)."""

    attn_norm: jax.Array  # [hidden]
    qkv_proj: jax.Array  # [hidden, 3 * hidden]
    o_proj: jax.Array  # [hidden, hidden]
    mlp_norm: jax.Array  # [hidden]
    router: jax.Array  # [hidden, num_experts]
    expert_up: jax.Array  # [num_experts, hidden, moe_intermediate]
    expert_down: jax.Array  # [num_experts, moe_intermediate, hidden]
    shared_up: jax.Array  # [hidden, moe_intermediate]
    shared_down: jax.Array  # [moe_intermediate, hidden]


def init_weights(key: jax.Array, config: ToyStackConfig) -> tuple[ToyLayerWeights, ...]:
    """Random weights for every layer (scaled so activations stay O(1))."""
    h, f, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    shapes = dict(
        attn_norm=(h,),
        qkv_proj=(h, 3 * h),
        o_proj=(h, h),
        mlp_norm=(h,),
        router=(h, e),
        expert_up=(e, h, f),
        expert_down=(e, f, h),
        shared_up=(h, f),
        shared_down=(f, h),
    )
    layers = []
    for layer_key in jax.random.split(key, config.num_layers):
        keys = dict(zip(shapes, jax.random.split(layer_key, len(shapes)), strict=True))
        layers.append(
            ToyLayerWeights(
                **{
                    name: (jax.random.normal(keys[name], shape) / math.sqrt(shape[-2])).astype(
                        config.dtype
                    )
                    if len(shape) > 1
                    else (1 + 0.1 * jax.random.normal(keys[name], shape)).astype(config.dtype)
                    for name, shape in shapes.items()
                }
            )
        )
    return tuple(layers)


def weight_specs(config: ToyStackConfig) -> tuple[ToyLayerWeights, ...]:
    """PartitionSpecs of ``init_weights``'s output: experts over ``dp``, the rest replicated."""
    replicated, experts = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(DP_AXIS)
    layer = ToyLayerWeights(**{f.name: replicated for f in dataclasses.fields(ToyLayerWeights)})
    layer = dataclasses.replace(layer, expert_up=experts, expert_down=experts)
    return (layer,) * config.num_layers


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def _ffn(x: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ up) @ down


def layer_operations(
    weights: ToyLayerWeights, config: ToyStackConfig
) -> dict[str, Callable[..., Any]]:
    """One layer's operations by SGLang name, over local weight shards (inside shard_map).

    Returns:
      name -> ``op(state, **inputs)``; feed it to ``strategy.OperationsStrategy.init_new_tbo``.
    """
    moe_ops = (
        _ep_operations(weights, config) if config.moe == "ep" else _dp_operations(weights, config)
    )
    ops = dict(_attention_operations(weights, config), **moe_ops)
    if config.shared_experts:
        ops["shared_experts"] = _shared_experts(weights)
    return ops


def _attention_operations(weights: ToyLayerWeights, config: ToyStackConfig) -> dict:
    h = config.hidden_size
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(h) / h))

    def comm_prepare_attn(state, hidden_states, residual, positions):
        residual = hidden_states + residual
        state.update(dict(residual=residual, positions=positions))
        state.attn_input = _rms_norm(residual, weights.attn_norm)

    def attn_prepare(state):
        state.qkv = state.pop("attn_input") @ weights.qkv_proj

    def attn_core(state):
        q, k, v = jnp.split(state.pop("qkv"), 3, axis=-1)
        angle = state.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
        rotated = q * jnp.cos(angle).astype(q.dtype) + k * jnp.sin(angle).astype(q.dtype)
        state.attn_output = (jax.nn.sigmoid(rotated) * v) @ weights.o_proj

    def comm_prepare_mlp(state):
        residual = state.pop("residual") + state.pop("attn_output")
        state.residual = residual
        state.mlp_input = _rms_norm(residual, weights.mlp_norm)

    def gate(state):
        state.router_logits = state.mlp_input @ weights.router

    def select_experts(state):
        probs = jax.nn.softmax(state.pop("router_logits").astype(jnp.float32), axis=-1)
        topk_weights, topk_ids = lax.top_k(probs, config.top_k)
        state.update(dict(topk_weights=topk_weights, topk_ids=topk_ids))

    def output(state):
        routed = state.pop("routed_output")
        shared = state.pop("shared_output") if config.shared_experts else 0
        state.mlp_output = routed + shared

    def comm_postprocess_layer(state):
        outputs = dict(
            hidden_states=state.mlp_output, residual=state.residual, positions=state.positions
        )
        state.clear(expect_keys=["mlp_output", "residual", "positions"])
        return outputs

    return dict(
        comm_prepare_attn=comm_prepare_attn,
        attn_prepare=attn_prepare,
        attn_core=attn_core,
        comm_prepare_mlp=comm_prepare_mlp,
        gate=gate,
        select_experts=select_experts,
        output=output,
        comm_postprocess_layer=comm_postprocess_layer,
    )


def _shared_experts(weights: ToyLayerWeights) -> Callable[..., None]:
    def shared_experts(state):
        state.shared_output = _ffn(state.pop("mlp_input"), weights.shared_up, weights.shared_down)

    return shared_experts


def _mlp_input(state, has_shared_experts: bool) -> jax.Array:
    # Without shared experts nothing reads the MLP input after dispatch: release it there.
    return state.mlp_input if has_shared_experts else state.pop("mlp_input")


def _ep_operations(weights: ToyLayerWeights, config: ToyStackConfig) -> dict:
    num_experts = config.num_experts

    def dispatch_a(state):
        tokens = _mlp_input(state, config.shared_experts)
        capacity = config.capacity or tokens.shape[0]
        slots = _expert_slots(state.topk_ids, num_experts)
        send = jnp.zeros((num_experts, capacity, tokens.shape[1]), tokens.dtype)
        send = send.at[state.topk_ids.reshape(-1), slots].set(
            jnp.repeat(tokens, config.top_k, axis=0), mode="drop"
        )
        state.slots = slots
        state.dispatch_recv = operations.InFlight(
            lax.all_to_all(send, DP_AXIS, split_axis=0, concat_axis=0, tiled=True)
        )

    def dispatch_b(state):
        state.dispatched = state.pop("dispatch_recv").value

    def experts(state):
        received = state.pop("dispatched")  # [ep * local_experts, capacity, hidden]
        local = weights.expert_up.shape[0]
        by_expert = received.reshape(-1, local, *received.shape[1:])
        up = jnp.einsum("selh,ehf->self", by_expert, weights.expert_up)
        down = jnp.einsum("self,efh->selh", jax.nn.gelu(up), weights.expert_down)
        state.expert_output = down.reshape(received.shape)

    def combine_a(state):
        state.combine_recv = operations.InFlight(
            lax.all_to_all(
                state.pop("expert_output"), DP_AXIS, split_axis=0, concat_axis=0, tiled=True
            )
        )

    def combine_b(state):
        returned = state.pop("combine_recv").value  # [num_experts, capacity, hidden]
        ids, slots = state.pop("topk_ids").reshape(-1), state.pop("slots")
        weights_k = state.pop("topk_weights")
        kept = slots < returned.shape[1]
        rows = returned[ids, jnp.where(kept, slots, 0)] * kept[:, None].astype(returned.dtype)
        rows = rows.reshape(*weights_k.shape, -1)
        state.routed_output = jnp.einsum("tkh,tk->th", rows, weights_k.astype(rows.dtype))

    return dict(
        dispatch_a=dispatch_a,
        dispatch_b=dispatch_b,
        experts=experts,
        combine_a=combine_a,
        combine_b=combine_b,
    )


def _expert_slots(topk_ids: jax.Array, num_experts: int) -> jax.Array:
    """Slot of each (token, choice) in its expert's buffer: its rank among that expert's choices."""
    return rows_lib.rank_within_group(topk_ids.reshape(-1), num_experts)  # [tokens * top_k]


def _dp_operations(weights: ToyLayerWeights, config: ToyStackConfig) -> dict:
    def dispatch_a(state):
        tokens = _mlp_input(state, config.shared_experts)
        num_experts = weights.router.shape[1]
        routing = jnp.zeros((tokens.shape[0], num_experts), jnp.float32)
        ids, topk_weights = state.pop("topk_ids"), state.pop("topk_weights")
        routing = routing.at[jnp.arange(tokens.shape[0])[:, None], ids].set(topk_weights)
        payload = jnp.concatenate([tokens, routing.astype(tokens.dtype)], axis=-1)
        state.dispatch_recv = operations.InFlight(
            lax.all_gather(payload, DP_AXIS, axis=0, tiled=True)
        )

    def dispatch_b(state):
        state.dispatched = state.pop("dispatch_recv").value

    def experts(state):
        gathered = state.pop("dispatched")  # [dp * tokens, hidden + num_experts]
        local = weights.expert_up.shape[0]
        hidden = weights.expert_up.shape[1]
        tokens, routing = gathered[:, :hidden], gathered[:, hidden:]
        first = lax.axis_index(DP_AXIS) * local
        local_routing = lax.dynamic_slice_in_dim(routing, first, local, axis=1)
        up = jax.nn.gelu(jnp.einsum("th,ehf->etf", tokens, weights.expert_up))
        state.expert_output = jnp.einsum("etf,efh,te->th", up, weights.expert_down, local_routing)

    def combine_a(state):
        state.combine_recv = operations.InFlight(
            lax.psum_scatter(state.pop("expert_output"), DP_AXIS, scatter_dimension=0, tiled=True)
        )

    def combine_b(state):
        state.routed_output = state.pop("combine_recv").value

    return dict(
        dispatch_a=dispatch_a,
        dispatch_b=dispatch_b,
        experts=experts,
        combine_a=combine_a,
        combine_b=combine_b,
    )


@dataclasses.dataclass(frozen=True)
class ToyStepOptions:
    """How a toy step runs: strategy, TBO on/off, barriers, child buffer size."""

    forward_mode: strategy.ForwardMode = strategy.ForwardMode.EXTEND  # chooses the layout
    enable_tbo: bool = True  # two overlapped micro-batches, or one plain pass
    barriers: bool = True  # round barriers (in-flight results left out)
    child_capacity: int | None = None  # rows per child buffer; None: all local tokens


def make_step(
    mesh: jax.sharding.Mesh,
    config: ToyStackConfig,
    options: ToyStepOptions,
    *,
    compiler_options: dict | None = None,
) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """Returns the jitted step ``(weights, hidden, residual, positions, split, num_tokens)``.

    ``hidden`` / ``residual`` are ``[dp * tokens, hidden]`` and ``positions`` ``[dp * tokens]``,
    rows split over ``dp``; ``split`` and ``num_tokens`` are ``[dp]`` int32 (each DP rank's
    split token index and real token count). Returns the last layer's hidden states and
    residual, same layout.
    """
    body = functools.partial(_step_body, config=config, options=options)
    rows, per_rank = jax.sharding.PartitionSpec(DP_AXIS), jax.sharding.PartitionSpec(DP_AXIS)
    in_specs = (
        weight_specs(config),  # weights: experts over dp, the rest replicated
        rows,  # hidden_states: token rows over dp
        rows,  # residual: token rows over dp
        rows,  # positions: token rows over dp
        per_rank,  # split_token_index: one per DP rank
        per_rank,  # num_tokens: one per DP rank
    )
    step = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(rows, rows), check_vma=False
    )
    return jax.jit(step, compiler_options=compiler_options)


def _step_body(weights, hidden_states, residual, positions, split, num_tokens, *, config, options):
    """One DP rank's layers over its local token rows."""
    layers = [layer_operations(layer, config) for layer in weights]
    tbo_split = layer_loop.TboSplit(
        split_token_index=split[0],
        num_tokens=num_tokens[0],
        child_capacity=options.child_capacity or hidden_states.shape[0],
    )
    family = (
        strategy.LayerFamily.DEEPSEEK if config.shared_experts else (strategy.LayerFamily.QWEN3_MOE)
    )
    return layer_loop.model_forward_maybe_tbo(
        layers,
        options.enable_tbo,
        positions,
        None,
        hidden_states,
        residual,
        tbo_split=tbo_split if options.enable_tbo else None,
        family=family,
        forward_mode=options.forward_mode,
        barriers=options.barriers,
    )


def abstract_step_args(
    mesh: jax.sharding.Mesh, config: ToyStackConfig, *, tokens_per_rank: int
) -> tuple[Any, ...]:
    """``ShapeDtypeStruct``s of ``make_step``'s arguments, sharded over ``mesh``.

    Args:
      mesh: a ``("dp", "attn_tp")`` mesh (e.g. ``jtbo.aot.gpu_mesh``).
      config: the stack.
      tokens_per_rank: token rows per DP rank.

    Returns:
      ``(weights, hidden_states, residual, positions, split_token_index, num_tokens)``.
    """

    def like(shape, dtype, spec):
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    weights = jax.eval_shape(lambda: init_weights(jax.random.key(0), config))
    weights = jax.tree.map(
        lambda w, spec: like(w.shape, w.dtype, spec), weights, weight_specs(config)
    )
    dp = mesh.shape[DP_AXIS]
    rows = jax.sharding.PartitionSpec(DP_AXIS)
    activation = like((dp * tokens_per_rank, config.hidden_size), config.dtype, rows)
    positions = like((dp * tokens_per_rank,), jnp.int32, rows)
    per_rank = like((dp,), jnp.int32, rows)
    return weights, activation, activation, positions, per_rank, per_rank
