"""A decoder layer's forward as jtbo operations with SGLang's strategy names.

Every operation is ``op(state, **inputs) -> outputs | None`` over a per-micro-batch
``OperationState``; ``jtbo.overlap.strategy`` arranges them with yields, so the same code runs
through ``execute_operations`` (one batch) and ``execute_overlapped_operations`` (two
micro-batches). The bodies run inside the step's ``shard_map`` over ``("dp", "attn_tp")`` and
see local shards.

Layout of activations: every layer keeps ``hidden_states`` and ``residual`` in SGLang's
TP_ATTN_FULL scatter mode (each attn_tp device holds all rows of its DP rank), with the residual
add fused into the next norm as SGLang does (``residual += hidden; hidden = norm(residual)``).

* ``attn_*``: Q/K/V of the local heads, RoPE, paged attention through the KV cache
  (``jtbo.attention.native``); ``comm_prepare_mlp`` sums the row-parallel output projection
  over ``attn_tp`` (all-reduce) before the post-attention norm.
* MoE ``ep``: each attn_tp device routes its ``1 / attn_tp`` block of rows; ``dispatch_a`` /
  ``combine_a`` issue the all-to-alls (``jtbo.models.moe_ep``), ``*_b`` consume them;
  ``combine_b`` all-gathers the blocks back over ``attn_tp``.
* MoE ``none``: ``dispatch_a`` DP-gathers rows and routing to every device
  (``jtbo.collectives.dp_gather_replicate``); every device runs all experts on its slice of the
  expert hidden width; ``combine_a`` reduce-scatters the partial sums back to the DP ranks
  (``dp_reduce_scatter_tensor``).

Context entries each micro-batch provides (read-only in its state): ``attn_metadata``,
``dp_context``, ``num_tokens`` (its real rows) and ``step_box`` (the KV cache, threaded through
micro-batch A's then B's attention of each layer, and the expert overflow counter).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jtbo.attention import native
from jtbo.collectives import gather, rows, scatter
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import experts, moe_ep, router
from jtbo.models import model as model_lib
from jtbo.overlap import operations

MOE_BACKENDS = ("ep", "none")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a layer runs over the ``("dp", "attn_tp")`` mesh (static: part of the compile).

    Attributes:
      moe_a2a_backend: "ep" (expert parallel, all-to-all) or "none" (DP gather + experts
        sharded on their hidden width + reduce-scatter).
      attn_tp_size: devices per DP rank.
      num_devices: devices of the whole TP group (``dp * attn_tp``).
      ep_capacity_factor: "ep" slots per (device, expert) as a multiple of the balanced load
        ``rows * top_k / num_experts`` (capped at ``rows``); None means ``rows``, which never
        drops a pair. Computed from each micro-batch's static rows, so TBO children get half.
    """

    moe_a2a_backend: Literal["ep", "none"]
    attn_tp_size: int
    num_devices: int
    ep_capacity_factor: float | None = None

    def ep_capacity(self, rows: int, top_k: int, num_experts: int) -> int:
        """EP slots per (device, expert) for a device routing ``rows`` rows."""
        if self.ep_capacity_factor is None:
            return rows
        return max(1, min(rows, math.ceil(self.ep_capacity_factor * rows * top_k / num_experts)))

    def __post_init__(self):
        if self.ep_capacity_factor is not None and self.ep_capacity_factor <= 0:
            raise ValueError(f"ep_capacity_factor={self.ep_capacity_factor} must be > 0")
        if self.moe_a2a_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_a2a_backend={self.moe_a2a_backend!r}: expected {MOE_BACKENDS}")


class StepBox:
    """Mutable state shared by both micro-batches of one traced step.

    Attributes:
      kv_cache: the DP rank's ``KVCache``; each attention replaces it with its updated copy.
      overflow: routed pairs dropped for lack of EP capacity (int32 scalar).
    """

    def __init__(self, kv_cache):
        """Args: kv_cache: the step's input KV cache (local shard)."""
        self.kv_cache = kv_cache
        self.overflow = jnp.zeros((), jnp.int32)


def _attn_tp_rank() -> jax.Array:
    return jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS)


def attention_operations(layer: model_lib.DecoderLayer, parallel: ParallelConfig) -> dict:
    """The attention half of a layer: ``comm_prepare_attn`` .. ``comm_prepare_mlp``.

    Args:
      layer: the layer's modules (local shards).
      parallel: the mesh layout.

    Returns:
      Operation name -> callable.
    """

    def comm_prepare_attn(state, hidden_states, residual, positions):
        residual = residual + hidden_states
        state.update(
            dict(
                positions=positions,
                residual_after_input_ln=residual,
                hidden_states_after_comm_pre_attn=layer.input_norm(residual),
            )
        )

    def attn_prepare(state):
        hidden = state.pop("hidden_states_after_comm_pre_attn")
        state.attn_qkv = layer.attn.qkv(hidden, state.positions)

    def attn_core(state):
        q, k, v = state.pop("attn_qkv")
        box = state.step_box
        out, box.kv_cache = native.forward(
            q, k, v, layer.layer_id, state.attn_metadata, box.kv_cache
        )
        state.hidden_states_after_attn = out

    def comm_prepare_mlp(state):
        out = layer.attn.output(state.pop("hidden_states_after_attn"))
        if parallel.attn_tp_size > 1:
            out = jax.lax.psum(out, mesh_lib.ATTN_TP_AXIS)
        residual = state.pop("residual_after_input_ln") + out
        state.residual_after_comm_pre_mlp = residual
        state.hidden_states_mlp_input = layer.post_attn_norm(residual)

    return dict(
        comm_prepare_attn=comm_prepare_attn,
        attn_prepare=attn_prepare,
        attn_core=attn_core,
        comm_prepare_mlp=comm_prepare_mlp,
    )


def _postprocess(state, mlp_output):
    """``comm_postprocess_layer``: the layer's outputs; the state must be empty afterwards."""
    out = dict(
        hidden_states=mlp_output,
        residual=state.pop("residual_after_comm_pre_mlp"),
        positions=state.pop("positions"),
    )
    state.clear(expect_keys=[])
    return out


def dense_layer_operations(layer: model_lib.DecoderLayer, parallel: ParallelConfig) -> list:
    """A dense-MLP layer as one stage of operations (it never runs overlapped).

    Args:
      layer: a layer with ``mlp``.
      parallel: the mesh layout.

    Returns:
      The operation list (no yields).
    """
    ops = attention_operations(layer, parallel)

    def mlp(state):
        state.hidden_states_mlp_output = layer.mlp(state.pop("hidden_states_mlp_input"))

    def comm_postprocess_layer(state):
        return _postprocess(state, state.pop("hidden_states_mlp_output"))

    named = {**ops, "mlp": mlp, "comm_postprocess_layer": comm_postprocess_layer}
    return [
        operations.ExecutionOperation(debug_name=f"L{layer.layer_id}.{name}", fn=fn)
        for name, fn in named.items()
    ]


def _padding_ids(topk_ids: jax.Array, num_tokens: jax.Array) -> jax.Array:
    """Marks the pairs of rows at or past ``num_tokens`` as unrouted (-1)."""
    real = jnp.arange(topk_ids.shape[0])[:, None] < num_tokens
    return jnp.where(real, topk_ids, -1)


def moe_layer_operations(
    layer: model_lib.DecoderLayer, config: config_lib.MoEConfig, parallel: ParallelConfig
) -> dict[str, Callable[..., Any]]:
    """A MoE layer's operations, keyed by SGLang's strategy names.

    ``shared_experts`` is present only when the config has shared experts (DeepSeek layout);
    without it the Qwen3-MoE layout applies.

    Args:
      layer: a layer with ``moe`` (local shards).
      config: the model config.
      parallel: the mesh layout.

    Returns:
      Operation name -> callable.
    """
    moe = layer.moe
    exchange_ops = _ep_operations(moe, config, parallel)
    if parallel.moe_a2a_backend == "none":
        exchange_ops = _gather_operations(moe, config)

    def gate(state):
        state.router_logits = moe.router.gate(state.hidden_states_mlp_input)

    def select_experts(state):
        bias = None if moe.router.correction_bias is None else moe.router.correction_bias[...]
        weights, ids = router.select_experts(state.pop("router_logits"), bias, config)
        state.topk_weights_local = weights
        state.topk_ids_local = _padding_ids(ids, state.num_tokens)

    def shared_experts(state):
        state.shared_output = moe.shared(state.hidden_states_mlp_input)

    def output(state):
        routed = state.pop("hidden_states_after_combine")
        state.pop("hidden_states_mlp_input")
        if moe.shared is not None:
            routed = routed + state.pop("shared_output")
        state.hidden_states_mlp_output = routed

    def comm_postprocess_layer(state):
        return _postprocess(state, state.pop("hidden_states_mlp_output"))

    ops = dict(
        attention_operations(layer, parallel),
        gate=gate,
        select_experts=select_experts,
        output=output,
        comm_postprocess_layer=comm_postprocess_layer,
        **exchange_ops,
    )
    if moe.shared is not None:
        ops["shared_experts"] = shared_experts
    return ops


def _ep_operations(moe: model_lib.MoEBlock, config, parallel: ParallelConfig) -> dict:
    """dispatch/experts/combine over the all-to-all (``moe_a2a_backend="ep"``)."""
    tp = parallel.attn_tp_size
    axes, devices = mesh_lib.TP_AXES, parallel.num_devices

    def dispatch_a(state):
        x = rows.attn_tp_shard(state.hidden_states_mlp_input, tp, _attn_tp_rank())
        ids = rows.attn_tp_shard(state.pop("topk_ids_local"), tp, _attn_tp_rank())
        capacity = parallel.ep_capacity(x.shape[0], config.num_experts_per_tok, config.num_experts)
        send, expert, position, overflow = moe_ep.pack(x, ids, config.num_experts, capacity)
        state.step_box.overflow = state.step_box.overflow + overflow
        state.slot_expert, state.slot_position = expert, position
        state.dispatch_in_flight = operations.InFlight(moe_ep.exchange(send, axes, devices))

    def dispatch_b(state):
        state.dispatch_output = state.pop("dispatch_in_flight").value

    def experts_op(state):
        received = state.pop("dispatch_output")
        state.expert_output = moe_ep.run_local_experts(received, moe.experts.weights, devices)

    def combine_a(state):
        back = moe_ep.exchange(state.pop("expert_output"), axes, devices)
        state.combine_in_flight = operations.InFlight(back)

    def combine_b(state):
        weights = rows.attn_tp_shard(state.pop("topk_weights_local"), tp, _attn_tp_rank())
        out = moe_ep.unpack(
            state.pop("combine_in_flight").value,
            state.pop("slot_expert"),
            state.pop("slot_position"),
            weights,
        )
        if tp > 1:
            out = jax.lax.all_gather(out, mesh_lib.ATTN_TP_AXIS, axis=0, tiled=True)
        state.hidden_states_after_combine = out

    return dict(
        dispatch_a=dispatch_a,
        dispatch_b=dispatch_b,
        experts=experts_op,
        combine_a=combine_a,
        combine_b=combine_b,
    )


def _gather_operations(moe: model_lib.MoEBlock, config) -> dict:
    """dispatch/experts/combine over DP gather + reduce-scatter (``moe_a2a_backend="none"``)."""

    def dispatch_a(state):
        ctx = state.dp_context
        gathered = (
            gather.dp_gather_replicate(state.hidden_states_mlp_input, ctx),
            gather.dp_gather_replicate(state.pop("topk_ids_local") + 1, ctx) - 1,
            gather.dp_gather_replicate(state.pop("topk_weights_local"), ctx),
        )
        state.dispatch_in_flight = operations.InFlight(gathered)

    def dispatch_b(state):
        state.dispatch_output = state.pop("dispatch_in_flight").value

    def experts_op(state):
        x, ids, weights = state.pop("dispatch_output")
        # Every device holds all experts' slice of the hidden width: a partial sum per row.
        state.expert_output = experts.experts_capacity(x, ids, weights, moe.experts.weights)

    def combine_a(state):
        reduced = scatter.dp_reduce_scatter_tensor(state.pop("expert_output"), state.dp_context)
        state.combine_in_flight = operations.InFlight(reduced)

    def combine_b(state):
        state.hidden_states_after_combine = state.pop("combine_in_flight").value

    return dict(
        dispatch_a=dispatch_a,
        dispatch_b=dispatch_b,
        experts=experts_op,
        combine_a=combine_a,
        combine_b=combine_b,
    )
