"""The MoE block's exchange operations: ``dispatch_a/b``, ``experts``, ``combine_a/b``.

Two backends, as SGLang's DP-attention MoE has:

* ``"ep"`` (expert parallel): each attn_tp device routes its ``1 / attn_tp`` block of the
  micro-batch's rows through the micro-batch's own ``jtbo.collectives`` EP dispatcher (the
  ``ep_dispatcher`` context entry; ``jtbo.models.ep_dispatchers``). ``dispatch_a`` and
  ``combine_a`` issue the all-to-alls (``operations.IssuingOperation``) and leave their
  results ``InFlight`` across the yield (so round barriers leave them out); ``dispatch_b`` /
  ``combine_b`` consume them. The local experts run over their capacity slots
  (``experts.experts_ffn_slots``: a batched matmul over every slot, or with
  ``moe_runner_backend="pallas"`` or ``"mosaic"`` a grouped GEMM over the filled ones;
  ``"mosaic"``'s outputs stay in its tile-major rows, which the combine reads through their
  slot index).
  ``combine_b`` all-gathers the blocks back over ``attn_tp``. Overflow counts go to the step
  box under the micro-batch's index. A dispatcher with ``dedup`` exchanges one row per
  (token, destination device) (``jtbo.collectives.ep_dedup``) instead of one per (token,
  expert); both fill the same expert slots.
* ``"none"``: ``dispatch_a`` DP-gathers rows and routing to every device (one gather: the
  expert ids and weights ride in the rows, ``rows.pack_int32_columns``); every device runs
  all experts on its slice of the expert hidden width; ``combine_a`` reduce-scatters the
  partial sums back to the DP ranks.

Both backends' ``experts`` have a joint form (``operations.JointOperation``) for the lockstep
executor of one-device TBO steps: one grouped GEMM over both micro-batches' rows (EP: their
slots concatenated per expert, ``slot_rows.concat_slots``, and each micro-batch's slot indices
moved to match, ``slot_rows.move_slots``), so each expert weight is read once per step.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jtbo.collectives import ep_dedup, ep_dispatch, gather, rows, scatter
from jtbo.collectives import mesh as mesh_lib
from jtbo.kernels import slot_rows
from jtbo.models import experts
from jtbo.models import model as model_lib
from jtbo.overlap import operations


def _exchange(dispatcher):
    """The dispatcher's dispatch/combine module: ``ep_dedup`` or ``ep_dispatch``."""
    return ep_dedup if dispatcher.dedup else ep_dispatch


def _attn_tp_shard(x: jax.Array, tp: int) -> jax.Array:
    return rows.attn_tp_shard(x, tp, jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS))


def _valid_rows_of_shard(num_tokens: jax.Array, shard_rows: int, tp: int) -> jax.Array:
    """Real rows in this attn_tp device's block of ``shard_rows`` rows."""
    start = jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS) * shard_rows
    return jax.numpy.clip(num_tokens - start, 0, shard_rows) if tp > 1 else num_tokens


def expert_counts(recv_expert_slot: jax.Array, num_local: int, capacity: int) -> jax.Array:
    """``[num_local]`` int32 filled slots per local expert, from ``DispatchState``'s slots.

    ``dispatch_b`` fills each local expert's slots from slot 0 up, so its rows are its first
    ``count`` slots.
    """
    expert = jnp.where(recv_expert_slot >= 0, recv_expert_slot // capacity, num_local)
    return jnp.bincount(expert, length=num_local + 1)[:num_local].astype(jnp.int32)


def ep_operations(
    moe: model_lib.MoEBlock, attn_tp_size: int, moe_runner_backend: str = "xla"
) -> dict:
    """``dispatch_a`` .. ``combine_b`` over the micro-batch's EP dispatcher.

    Args:
      moe: the layer's MoE block (local expert shards).
      attn_tp_size: devices per DP rank.
      moe_runner_backend: the expert FFN's impl, "xla", "pallas" or "mosaic"
        (``experts_ffn_slots``).

    Returns:
      Operation name -> callable.
    """

    def ffn(inputs, counts, max_rows):
        # combine_a reads only the filled slots: the kernel need not zero the rest.
        return experts.experts_ffn_slots(
            inputs, counts, moe.experts.weights, impl=moe_runner_backend, max_rows=max_rows,
            zero_padding=False, fp8_activations=moe.experts.fp8_activations,
        )  # fmt: skip

    def experts_op(state):
        inputs, dispatch_state = state.pop("dispatch_output")
        counts, max_rows = _slot_counts(inputs, dispatch_state)
        state.expert_output = (ffn(inputs, counts, max_rows), dispatch_state)

    def experts_joint(states, inputs):
        del inputs  # the experts read the state only
        (slots_a, state_a), (slots_b, state_b) = [s.pop("dispatch_output") for s in states]
        (counts_a, rows_a), (counts_b, rows_b) = map(
            _slot_counts, (slots_a, slots_b), (state_a, state_b)
        )
        joint = slot_rows.concat_slots(slots_a, counts_a, slots_b)
        outputs = ffn(joint, counts_a + counts_b, rows_a + rows_b)
        for state, slots, dispatch_state, offset in zip(
            states, (slots_a, slots_b), (state_a, state_b), (jnp.zeros_like(counts_a), counts_a),
            strict=True,
        ):  # fmt: skip
            moved = slot_rows.move_slots(
                dispatch_state.recv_expert_slot, slots.shape[1], joint.shape[1], offset
            )
            state.expert_output = (
                outputs,
                dataclasses.replace(dispatch_state, recv_expert_slot=moved),
            )
        return None, None

    return dict(
        **_ep_dispatch_operations(attn_tp_size),
        experts=operations.JointOperation(experts_op, experts_joint),
        **_ep_combine_operations(attn_tp_size),
    )


def _slot_counts(inputs: slot_rows.SlotRows, dispatch_state) -> tuple[jax.Array, int]:
    """``([num_local] int32 filled slots per local expert, static bound on their sum)``."""
    num_local, capacity = inputs.shape[:2]
    counts = expert_counts(dispatch_state.recv_expert_slot, num_local, capacity)
    return counts, min(num_local * capacity, dispatch_state.recv_expert_slot.shape[0])


def _ep_dispatch_operations(tp: int) -> dict:
    """``dispatch_a`` (issue; the exchange stays ``InFlight``) and ``dispatch_b`` (consume)."""

    def dispatch_a(state):
        x = _attn_tp_shard(state.hidden_states_mlp_input, tp)
        ids = _attn_tp_shard(state.pop("topk_ids_local"), tp)
        weights = _attn_tp_shard(state.pop("topk_weights_local"), tp)
        valid = _valid_rows_of_shard(state.num_tokens, x.shape[0], tp)
        issued = _exchange(state.ep_dispatcher).dispatch_a(
            state.ep_dispatcher, x, ids, weights, valid
        )
        state.dispatch_in_flight = operations.InFlight(issued)

    def dispatch_b(state):
        inputs, dispatch_state = _exchange(state.ep_dispatcher).dispatch_b(
            state.ep_dispatcher, state.pop("dispatch_in_flight").value
        )
        state.step_box.add_overflow(
            state.micro_batch, dispatch_state.overflow, dispatch_state.peak_load
        )
        state.dispatch_output = (inputs, dispatch_state)

    return dict(dispatch_a=operations.IssuingOperation(dispatch_a), dispatch_b=dispatch_b)


def _ep_combine_operations(tp: int) -> dict:
    """``combine_a`` (issue the way back) and ``combine_b`` (weighted sum, attn_tp gather)."""

    def combine_a(state):
        outputs, dispatch_state = state.pop("expert_output")
        issued = _exchange(state.ep_dispatcher).combine_a(
            state.ep_dispatcher, outputs, dispatch_state
        )
        state.combine_in_flight = operations.InFlight(issued)

    def combine_b(state):
        in_flight = state.pop("combine_in_flight").value
        out = _exchange(state.ep_dispatcher).combine_b(state.ep_dispatcher, in_flight)
        if tp > 1:
            out = jax.lax.all_gather(out, mesh_lib.ATTN_TP_AXIS, axis=0, tiled=True)
        state.hidden_states_after_combine = out

    return dict(combine_a=operations.IssuingOperation(combine_a), combine_b=combine_b)


def gather_operations(moe: model_lib.MoEBlock, moe_runner_backend: str = "xla") -> dict:
    """``dispatch_a`` .. ``combine_b`` over DP gather + reduce-scatter (no EP).

    Args:
      moe: the layer's MoE block (every expert, a slice of its hidden width).
      moe_runner_backend: the expert FFN's impl, "xla", "pallas" or "mosaic"
        (``experts_ffn_slots``).

    Returns:
      Operation name -> callable.
    """

    def dispatch_a(state):
        # One gather: the ids (+1, so that rows past a rank's tokens read -1) and the routing
        # weights ride in trailing columns of the hidden rows; unpacked in dispatch_b, so the
        # gathered buffer stays whole while in flight.
        x = state.hidden_states_mlp_input
        ids = state.pop("topk_ids_local").astype(jnp.int32) + 1
        weights = state.pop("topk_weights_local").astype(jnp.float32)
        side = jnp.concatenate([ids, jax.lax.bitcast_convert_type(weights, jnp.int32)], axis=1)
        payload = rows.pack_int32_columns(x, side)
        state.dispatch_in_flight = operations.InFlight(
            gather.dp_gather_replicate(payload, state.dp_context)
        )

    def dispatch_b(state):
        hidden = moe.experts.weights[0].shape[1]
        x, side = rows.unpack_int32_columns(state.pop("dispatch_in_flight").value, hidden)
        ids, weights = jnp.split(side, 2, axis=1)
        state.dispatch_output = (x, ids - 1, jax.lax.bitcast_convert_type(weights, jnp.float32))

    def combine_a(state):
        reduced = scatter.dp_reduce_scatter_tensor(state.pop("expert_output"), state.dp_context)
        state.combine_in_flight = operations.InFlight(reduced)

    def combine_b(state):
        state.hidden_states_after_combine = state.pop("combine_in_flight").value

    return dict(
        dispatch_a=operations.IssuingOperation(dispatch_a),
        dispatch_b=dispatch_b,
        experts=_gather_experts_operation(moe, moe_runner_backend),
        combine_a=operations.IssuingOperation(combine_a),
        combine_b=combine_b,
    )


def _gather_experts_operation(
    moe: model_lib.MoEBlock, moe_runner_backend: str
) -> operations.JointOperation:
    """The ``"none"`` backend's ``experts``: every expert over the gathered rows, with a joint
    form over both micro-batches' rows."""

    def ffn(x, ids, weights):
        # Every device holds all experts' slice of the hidden width: a partial sum per row.
        return experts.experts_capacity(
            x, ids, weights, moe.experts.weights, impl=moe_runner_backend,
            fp8_activations=moe.experts.fp8_activations,
        )  # fmt: skip

    def experts_op(state):
        state.expert_output = ffn(*state.pop("dispatch_output"))

    def experts_joint(states, inputs):
        del inputs  # the experts read the state only
        parts = [state.pop("dispatch_output") for state in states]
        out = ffn(*(jnp.concatenate(columns) for columns in zip(*parts, strict=True)))
        first_rows = parts[0][0].shape[0]
        states[0].expert_output, states[1].expert_output = out[:first_rows], out[first_rows:]
        return None, None

    return operations.JointOperation(experts_op, experts_joint)
