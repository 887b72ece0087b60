"""Expert-parallel dispatch and combine with one row per (token, destination device).

The deduplicated twin of ``jtbo.collectives.ep_dispatch`` (selected by
``EpDispatcher.dedup``), as DeepEP sends a token once to each rank that holds any of its
experts instead of once per expert. Same halves, same receive layout for the experts:

1. ``dispatch_a`` (sender): a token *hits* a device when one of its routed experts lives there.
   Each (token, device) hit is numbered within its device in token order; the first
   ``peer_capacity`` go into that device's slots of the ``[ep, peer_capacity, ...]`` send
   buffer, the rest are counted as peer overflow. A row carries the token's hidden state and,
   in ``2 * m`` trailing bitcast columns (``m = min(top_k, num_local_experts)``, the most
   experts a token can have on one device), its local expert ids on that device (in top-k
   order, -1 padding) and their float32 routing weights. One payload, one exchange, issued and
   left unread (dense ``lax.all_to_all`` or ``lax.ragged_all_to_all`` of the filled slots).
2. ``dispatch_b`` (receiver): every (row, id column) with an id is one assignment. Assignments
   are numbered within their local expert in (source, slot, column) order; the first
   ``expert_capacity`` take that expert's slots of ``[num_local_experts, expert_capacity,
   H]``, the rest are expert overflow. The slots name their received rows
   (``kernels.SlotRows``) rather than copy them. The layout is ``ep_dispatch``'s, so the
   expert FFN is unchanged.
3. ``combine_a`` (receiver): per received row, the weighted sum of its kept experts' outputs
   (float32 accumulate, cast back to the outputs' dtype): one row per (token, device) goes
   back.
4. ``combine_b`` (sender): per token, the sum (float32) of the rows that came back from each
   device it hit.

The result equals ``ep_dispatch``'s up to float rounding: each device's partial sum is rounded
to the outputs' dtype once before the sender adds the partial sums. Overflow and peak load
keep ``ep_dispatch``'s meaning with peer rows counted as (token, device) pairs: ``overflow``
``[2]`` (peer rows that did not fit, assignments that did not fit an expert), ``peak_load``
``[2]`` (most rows one peer was sent, most assignments one local expert was given, kept or
not). Every dropped row or assignment is counted, so ``ep_overflow`` re-runs exactly.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jtbo.collectives import ep_config, peer_copy
from jtbo.collectives import ep_dispatch as ep_lib
from jtbo.collectives import rows as rows_lib
from jtbo.kernels import slot_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DedupDispatchInFlight:
    """``dispatch_a``'s result: the exchange in flight and the sender's routing."""

    # [ep * peer_capacity, H + id and weight columns] rows by source device, each with its m
    # int32 local expert ids (-1 none) and m float32 weights bitcast into trailing columns (in
    # flight). Kept packed until dispatch_b, as ep_dispatch.DispatchInFlight.recv_payload.
    recv_payload: peer_copy.InFlight
    hidden_width: int = dataclasses.field(metadata=dict(static=True))  # H
    send_slot: jax.Array  # [T, ep] int32 send-buffer slot of each (token, device), -1 none
    send_counts: jax.Array  # [ep] int32 rows sent to each device
    peer_overflow: jax.Array  # [1] int32 (token, device) rows that did not fit peer_capacity
    peer_peak: jax.Array  # [1] int32 most rows bound for one peer (kept or not)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DedupDispatchState:
    """What combine needs to reduce and route expert outputs back; ``overflow`` goes to the host."""

    # [ep * peer_capacity * m] int32 flat expert slot of each (received row, id column), -1
    # none: ep_dispatch.DispatchState.recv_expert_slot's meaning, so expert counts read alike.
    recv_expert_slot: jax.Array
    recv_weights: jax.Array  # [ep * peer_capacity, m] float32 weight per id column, 0 none
    recv_counts: jax.Array  # [ep] int32 rows received from each device
    send_slot: jax.Array  # [T, ep] int32 send-buffer slot of each (token, device), -1 none
    send_counts: jax.Array  # [ep] int32 rows sent to each device
    overflow: jax.Array  # [2] int32 (peer rows, expert assignments) dropped
    peak_load: jax.Array  # [2] int32 most rows for one peer, assignments for one local expert


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DedupCombineInFlight:
    """``combine_a``'s result: per (token, device) partial sums on their way back."""

    returned: peer_copy.InFlight  # [ep * peer_capacity, H_out] partial sums by destination
    send_slot: jax.Array  # [T, ep] int32 send-buffer slot of each (token, device), -1 none


def dispatch_a(
    dispatcher: ep_config.EpDispatcher,
    hidden_states: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    num_valid_tokens: jax.Array | int,
) -> DedupDispatchInFlight:
    """Lays each token once into the slots of every device it hits and issues the exchange.

    Args:
      dispatcher: the micro-batch's dispatcher (``dedup=True``).
      hidden_states: ``[num_tokens, H]`` this device's tokens.
      topk_ids: ``[num_tokens, top_k]`` distinct global expert ids per token (ids outside
        ``[0, num_experts)`` are not dispatched).
      topk_weights: ``[num_tokens, top_k]`` routing weights.
      num_valid_tokens: leading rows that are real tokens (traced or static).

    Returns:
      The in-flight exchange; hand it to ``dispatch_b`` (after a yield, for overlap).

    Raises:
      ValueError: shapes that do not match the dispatcher or the mesh, or a dispatcher
        without ``dedup``.
    """
    if not dispatcher.dedup:
        raise ValueError("ep_dedup needs a dispatcher with dedup=True; use ep_dispatch")
    ep_lib._check_inputs(dispatcher, hidden_states, topk_ids, topk_weights)
    ids = topk_ids.astype(jnp.int32)
    is_token = jnp.arange(dispatcher.num_tokens, dtype=jnp.int32)[:, None] < num_valid_tokens
    routed = is_token & (ids >= 0) & (ids < dispatcher.num_experts)
    peer = jnp.where(routed, ep_lib._div(ids, dispatcher.num_local_experts), dispatcher.ep_size)
    send_slot, send_counts, overflow, peak = _assign_peer_slots(dispatcher, peer)
    payload = _fill_send_buffer(dispatcher, hidden_states, ids, topk_weights, peer, send_slot)
    received = ep_lib._send(
        dispatcher, payload, send_counts,
        lambda: _empty_payload(dispatcher, hidden_states.shape[1], payload.dtype),
    )  # fmt: skip
    return DedupDispatchInFlight(
        recv_payload=received,
        hidden_width=hidden_states.shape[1],
        send_slot=send_slot,
        send_counts=send_counts,
        peer_overflow=overflow.reshape(1),
        peer_peak=peak.reshape(1),
    )


def dispatch_b(
    dispatcher: ep_config.EpDispatcher, in_flight: DedupDispatchInFlight
) -> tuple[slot_rows.SlotRows, DedupDispatchState]:
    """Consumes the exchange: each received row into its local experts' capacity slots.

    Args:
      dispatcher: the micro-batch's dispatcher.
      in_flight: ``dispatch_a``'s result.

    Returns:
      ``(expert_inputs, state)``: the ``[num_local_experts, expert_capacity, H]`` slots as
      ``SlotRows`` (the received rows and the row each slot holds, -1 empty; the Pallas
      grouped GEMM loads through the index, ``materialize()`` gives the slot buffer) and the
      state ``combine_a`` needs.
    """
    num_local, capacity = dispatcher.num_local_experts, dispatcher.expert_capacity
    m = dispatcher.local_ids_per_row
    recv_hidden, columns = rows_lib.unpack_int32_columns(
        ep_lib._finish(dispatcher, in_flight.recv_payload), in_flight.hidden_width
    )
    expert, weights = columns[:, :m], jax.lax.bitcast_convert_type(columns[:, m:], jnp.float32)
    assigned = (expert >= 0).reshape(-1)  # (source, slot, column) order
    rank = rows_lib.rank_within_group(jnp.where(assigned, expert.reshape(-1), num_local), num_local)
    kept = assigned & (rank < capacity)
    recv_expert_slot = jnp.where(kept, expert.reshape(-1) * capacity + rank, -1)
    assignment = slot_rows.invert_slots(recv_expert_slot, num_local * capacity)
    row = jnp.where(assignment >= 0, ep_lib._div(assignment, m), -1)
    rows_per_peer = (expert[:, 0] >= 0).reshape(dispatcher.ep_size, dispatcher.peer_capacity)
    expert_overflow = jnp.sum(assigned & ~kept, dtype=jnp.int32)
    state = DedupDispatchState(
        recv_expert_slot=recv_expert_slot,
        recv_weights=jnp.where(expert >= 0, weights, 0.0),
        recv_counts=jnp.sum(rows_per_peer, axis=1, dtype=jnp.int32),
        send_slot=in_flight.send_slot,
        send_counts=in_flight.send_counts,
        overflow=jnp.concatenate([in_flight.peer_overflow, expert_overflow.reshape(1)]),
        peak_load=jnp.concatenate([in_flight.peer_peak, ep_lib._peak(rank, assigned).reshape(1)]),
    )
    return slot_rows.SlotRows(recv_hidden, row.reshape(num_local, capacity)), state


def combine_a(
    dispatcher: ep_config.EpDispatcher, expert_outputs: jax.Array, state: DedupDispatchState
) -> DedupCombineInFlight:
    """Reduces each received row's expert outputs to one weighted row and issues it back.

    Args:
      dispatcher: the micro-batch's dispatcher.
      expert_outputs: ``[num_local_experts, C, H_out]`` (``C`` as ``state``'s slots count:
        ``expert_capacity``, or a joint GEMM's, ``ep_dispatch.checked_expert_outputs``), or
        ``SlotRows`` standing for it (the ``"mosaic"`` grouped FFN's).
      state: ``dispatch_b``'s state.

    Returns:
      The in-flight return exchange; hand it to ``combine_b``.

    Raises:
      ValueError: ``expert_outputs`` does not have the slot layout.
    """
    outputs = ep_lib.checked_expert_outputs(dispatcher, expert_outputs)
    slot = state.recv_expert_slot.reshape(state.recv_weights.shape)
    # One [rows, H] gather per id column, summed as they come: a [rows, m, H] float32
    # intermediate would be m times the exchange's size if XLA did not fuse the reduction.
    back = jnp.zeros((slot.shape[0],) + tuple(outputs.shape[2:]), jnp.float32)
    for column in range(slot.shape[1]):
        rows = slot_rows.take_flat(outputs, slot[:, column]).astype(jnp.float32)
        back = back + state.recv_weights[:, column, None] * rows
    back = back.astype(expert_outputs.dtype)
    returned = ep_lib._send_back(dispatcher, back, state.recv_counts, state.send_counts)
    return DedupCombineInFlight(returned=returned, send_slot=state.send_slot)


def combine_b(dispatcher: ep_config.EpDispatcher, in_flight: DedupCombineInFlight) -> jax.Array:
    """Consumes the return exchange: per token, the sum of the partial sums of every device.

    Args:
      dispatcher: the micro-batch's dispatcher.
      in_flight: ``combine_a``'s result.

    Returns:
      ``[num_tokens, H_out]`` in the expert outputs' dtype; zero for tokens that were not
      dispatched.
    """
    returned = ep_lib._finish(dispatcher, in_flight.returned)
    per_device = slot_rows.gather_rows(returned, in_flight.send_slot.reshape(-1))
    per_device = per_device.reshape(in_flight.send_slot.shape + (-1,))
    combined = jnp.sum(per_device.astype(jnp.float32), axis=1)
    return combined.astype(returned.dtype)


def _assign_peer_slots(dispatcher, peer):
    """Numbers each (token, device) hit within its device; ``peer`` is ``[T, top_k]``."""
    ep_size, capacity = dispatcher.ep_size, dispatcher.peer_capacity
    devices = jnp.arange(ep_size, dtype=jnp.int32)
    hits = jnp.any(peer[:, :, None] == devices[None, None, :], axis=1)  # [T, ep]
    rank = jnp.cumsum(hits, axis=0, dtype=jnp.int32) - hits  # exclusive, in token order
    kept = hits & (rank < capacity)
    send_slot = jnp.where(kept, devices[None, :] * capacity + rank, -1)
    send_counts = jnp.sum(kept, axis=0, dtype=jnp.int32)
    overflow = jnp.sum(hits & ~kept, dtype=jnp.int32)
    peak = jnp.max(jnp.sum(hits, axis=0, dtype=jnp.int32))
    return send_slot, send_counts, overflow, peak


def _fill_send_buffer(dispatcher, hidden_states, ids, topk_weights, peer, send_slot):
    """``[ep * peer_capacity, H + id and weight columns]``: each kept hit's row, packed."""
    ep_size, capacity, m = (
        dispatcher.ep_size,
        dispatcher.peer_capacity,
        dispatcher.local_ids_per_row,
    )
    item = slot_rows.invert_slots(send_slot.reshape(-1), ep_size * capacity)  # token * ep + device
    token = jnp.where(item >= 0, ep_lib._div(item, ep_size), -1)
    send_hidden = slot_rows.gather_rows(hidden_states, token)
    # Column c of a slot holds the token's (c+1)-th expert (top-k order) on the slot's device.
    slot_device = jnp.arange(ep_size * capacity, dtype=jnp.int32) // capacity
    column = _column_on_device(peer)  # [T, top_k]
    at = jnp.maximum(token, 0)
    on_device = (peer[at] == slot_device[:, None]) & (token[:, None] >= 0)  # [slots, top_k]
    match = on_device[:, None, :] & (column[at][:, None, :] == jnp.arange(m)[None, :, None])
    local = ids[at] - ep_lib._div(ids[at], dispatcher.num_local_experts) * (
        dispatcher.num_local_experts
    )
    send_ids = jnp.sum(jnp.where(match, local[:, None, :] + 1, 0), axis=2) - 1  # [slots, m]
    weights = topk_weights[at].astype(jnp.float32)
    send_weights = jnp.sum(jnp.where(match, weights[:, None, :], 0.0), axis=2)
    bits = jax.lax.bitcast_convert_type(send_weights, jnp.int32)
    return rows_lib.pack_int32_columns(send_hidden, jnp.concatenate([send_ids, bits], axis=1))


def _column_on_device(peer):
    """``[T, top_k]`` how many earlier top-k choices of the token went to the same device."""
    top_k = peer.shape[1]
    same = peer[:, :, None] == peer[:, None, :]  # [T, top_k, top_k]
    earlier = jnp.arange(top_k)[None, :] < jnp.arange(top_k)[:, None]  # [j, j'] j' before j
    return jnp.sum(same & earlier[None], axis=2, dtype=jnp.int32)


def _empty_payload(dispatcher, width, dtype):
    """What unreceived rows of a ragged exchange hold: zeros, ids -1, weights 0."""
    rows = dispatcher.ep_size * dispatcher.peer_capacity
    m = dispatcher.local_ids_per_row
    ids = jnp.concatenate([jnp.full((rows, m), -1, jnp.int32), jnp.zeros((rows, m), jnp.int32)], 1)
    return rows_lib.pack_int32_columns(jnp.zeros((rows, width), dtype), ids)
