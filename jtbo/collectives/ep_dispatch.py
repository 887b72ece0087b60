"""Expert-parallel dispatch and combine, each split into an issuing and a consuming half.

Inside ``jax.shard_map`` over the mesh, each device routes its ``[T, H]`` tokens to ``top_k``
experts; an expert lives on one device of the EP group (``jtbo.collectives.ep_config``).

Dispatch:

1. ``dispatch_a`` (issue, on the sender): number each (token, k) assignment within its
   destination device in token order; the first ``peer_capacity`` go into that peer's slots of
   a ``[ep, peer_capacity, H]`` send buffer together with their local expert id (-1 marks an
   empty slot); the rest are counted as peer overflow. The ids ride in trailing columns of the
   rows (bitcast, one payload). Then it *issues* the exchange - dense: ``lax.all_to_all`` of
   the fixed slots; ragged: a small all-to-all of the slot counts, then
   ``lax.ragged_all_to_all`` of only the filled slots into the same receive layout - and
   returns without reading the result, so the exchange can overlap the other micro-batch.
2. ``dispatch_b`` (consume, on the receiver): split the received payload into rows and ids,
   number the received rows within their local expert in (source, slot) order; the first
   ``expert_capacity`` take that expert's slots of ``[num_local_experts, expert_capacity, H]``
   (empty elsewhere), the rest are expert overflow. The slots name their received rows
   (``kernels.SlotRows``): the grouped GEMM loads through that index, so no slot buffer is
   written.

Combine runs the same way back: ``combine_a`` picks each received row's expert output and
issues the reverse exchange; ``combine_b`` sums, per token, ``weight * output`` over its
``top_k`` assignments (accumulated in float32). Padded tokens (rows at or past
``num_valid_tokens``), out-of-range expert ids and overflowed assignments contribute zero, and
every overflowed assignment is counted exactly once in the dispatch state's ``overflow``
(``[peer, expert]`` per device). The state's ``peak_load`` holds the largest number of
assignments one peer and one local expert were given (kept or not): the capacities this
dispatch needed, from which the host sizes a re-run (``ep_overflow.resolve_overflow``). Both
exchanges give identical results.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jtbo.collectives import ep_config, peer_copy
from jtbo.collectives import rows as rows_lib
from jtbo.kernels import slot_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchInFlight:
    """``dispatch_a``'s result: the exchange in flight and the sender's routing."""

    # [ep * peer_capacity, H + id columns] rows by source device, each with its int32 local
    # expert id (-1 empty) bitcast into trailing columns (in flight). Kept packed until
    # dispatch_b: a TBO issue barrier pins in-flight values, and a slice taken here would be
    # pinned as its own copy of every received row instead of fusing into dispatch_b's gather.
    recv_payload: peer_copy.InFlight
    hidden_width: int = dataclasses.field(metadata=dict(static=True))  # H
    send_slot: jax.Array  # [T, top_k] int32 send-buffer slot of each assignment, -1 none
    send_counts: jax.Array  # [ep] int32 rows sent to each device
    topk_weights: jax.Array  # [T, top_k] routing weights
    peer_overflow: jax.Array  # [1] int32 assignments that did not fit peer_capacity
    peer_peak: jax.Array  # [1] int32 most assignments bound for one peer (kept or not)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchState:
    """What combine needs to route expert outputs back; ``overflow`` goes to the host."""

    recv_expert_slot: jax.Array  # [ep * peer_capacity] int32 flat expert slot, -1 none
    recv_counts: jax.Array  # [ep] int32 rows received from each device
    send_slot: jax.Array  # [T, top_k] int32 send-buffer slot of each assignment, -1 none
    send_counts: jax.Array  # [ep] int32 rows sent to each device
    topk_weights: jax.Array  # [T, top_k] routing weights
    overflow: jax.Array  # [2] int32 assignments dropped for (peer_capacity, expert_capacity)
    peak_load: jax.Array  # [2] int32 most assignments for one (peer, local expert), kept or not


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CombineInFlight:
    """``combine_a``'s result: expert outputs on their way back, and the sender's routing."""

    returned: peer_copy.InFlight  # [ep * peer_capacity, H] outputs by destination device
    send_slot: jax.Array  # [T, top_k] int32 send-buffer slot of each assignment, -1 none
    topk_weights: jax.Array  # [T, top_k] routing weights


def dispatch_a(
    dispatcher: ep_config.EpDispatcher,
    hidden_states: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    num_valid_tokens: jax.Array | int,
) -> DispatchInFlight:
    """Lays this device's assignments into peer slots and issues the exchange.

    Args:
      dispatcher: the micro-batch's dispatcher.
      hidden_states: ``[num_tokens, H]`` this device's tokens.
      topk_ids: ``[num_tokens, top_k]`` global expert ids (ids outside ``[0, num_experts)``
        are not dispatched).
      topk_weights: ``[num_tokens, top_k]`` routing weights.
      num_valid_tokens: leading rows that are real tokens (traced or static).

    Returns:
      The in-flight exchange; hand it to ``dispatch_b`` (after a yield, for overlap).

    Raises:
      ValueError: shapes that do not match the dispatcher or the mesh.
    """
    _check_inputs(dispatcher, hidden_states, topk_ids, topk_weights)
    send_slot, send_counts, peer_overflow, peer_peak = _assign_peer_slots(
        dispatcher, topk_ids, num_valid_tokens
    )
    send_hidden, send_expert = _fill_send_buffer(dispatcher, hidden_states, topk_ids, send_slot)
    payload = rows_lib.pack_int32_columns(send_hidden, send_expert[:, None])
    received = _send(
        dispatcher, payload, send_counts,
        lambda: rows_lib.pack_int32_columns(  # empty rows: zeros, expert id -1
            jnp.zeros_like(send_hidden), jnp.full((send_expert.shape[0], 1), -1, jnp.int32)
        ),
    )  # fmt: skip
    return DispatchInFlight(
        recv_payload=received,
        hidden_width=hidden_states.shape[1],
        send_slot=send_slot,
        send_counts=send_counts,
        topk_weights=topk_weights,
        peer_overflow=peer_overflow.reshape(1),
        peer_peak=peer_peak.reshape(1),
    )


def dispatch_b(
    dispatcher: ep_config.EpDispatcher, in_flight: DispatchInFlight
) -> tuple[slot_rows.SlotRows, DispatchState]:
    """Consumes the exchange: received rows into per-expert capacity slots.

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
    payload = _finish(dispatcher, in_flight.recv_payload)
    recv_hidden, ids = rows_lib.unpack_int32_columns(payload, in_flight.hidden_width)
    expert = ids[:, 0]
    received = expert >= 0
    rank = rows_lib.rank_within_group(jnp.where(received, expert, num_local), num_local)
    kept = received & (rank < capacity)
    expert_overflow = jnp.sum(received & ~kept, dtype=jnp.int32)
    expert_peak = _peak(rank, received)
    recv_expert_slot = jnp.where(kept, expert * capacity + rank, -1)
    rows = slot_rows.invert_slots(recv_expert_slot, num_local * capacity)
    rows_per_peer = received.reshape(dispatcher.ep_size, dispatcher.peer_capacity)
    state = DispatchState(
        recv_expert_slot=recv_expert_slot,
        recv_counts=jnp.sum(rows_per_peer, axis=1, dtype=jnp.int32),
        send_slot=in_flight.send_slot,
        send_counts=in_flight.send_counts,
        topk_weights=in_flight.topk_weights,
        overflow=jnp.concatenate([in_flight.peer_overflow, expert_overflow.reshape(1)]),
        peak_load=jnp.concatenate([in_flight.peer_peak, expert_peak.reshape(1)]),
    )
    return slot_rows.SlotRows(recv_hidden, rows.reshape(num_local, capacity)), state


def combine_a(
    dispatcher: ep_config.EpDispatcher, expert_outputs: jax.Array, state: DispatchState
) -> CombineInFlight:
    """Picks each received row's expert output and issues the exchange back.

    Args:
      dispatcher: the micro-batch's dispatcher.
      expert_outputs: ``[num_local_experts, C, H_out]`` (``C`` as ``state``'s slots count:
        ``expert_capacity``, or a joint GEMM's, ``checked_expert_outputs``), or ``SlotRows``
        standing for it (the ``"mosaic"`` grouped FFN's).
      state: ``dispatch_b``'s state.

    Returns:
      The in-flight return exchange; hand it to ``combine_b``.

    Raises:
      ValueError: ``expert_outputs`` does not have the slot layout.
    """
    back = slot_rows.take_flat(
        checked_expert_outputs(dispatcher, expert_outputs), state.recv_expert_slot
    )
    returned = _send_back(dispatcher, back, state.recv_counts, state.send_counts)
    return CombineInFlight(
        returned=returned, send_slot=state.send_slot, topk_weights=state.topk_weights
    )


def combine_b(dispatcher: ep_config.EpDispatcher, in_flight: CombineInFlight) -> jax.Array:
    """Consumes the return exchange: per token, the weighted sum of its experts' outputs.

    Args:
      dispatcher: the micro-batch's dispatcher.
      in_flight: ``combine_a``'s result.

    Returns:
      ``[num_tokens, H_out]`` in the expert outputs' dtype; zero for tokens that were not
      dispatched.
    """
    returned = _finish(dispatcher, in_flight.returned)
    per_assignment = slot_rows.gather_rows(returned, in_flight.send_slot.reshape(-1))
    per_assignment = per_assignment.reshape(in_flight.send_slot.shape + (-1,))
    weights = in_flight.topk_weights.astype(jnp.float32)[..., None]
    combined = jnp.sum(weights * per_assignment.astype(jnp.float32), axis=1)
    return combined.astype(returned.dtype)


def _check_inputs(dispatcher, hidden_states, topk_ids, topk_weights):
    tokens, top_k = dispatcher.num_tokens, dispatcher.top_k
    if hidden_states.ndim != 2 or hidden_states.shape[0] != tokens:
        raise ValueError(f"hidden_states shape {hidden_states.shape} must be [{tokens}, H]")
    for name, x in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if x.shape != (tokens, top_k):
            raise ValueError(f"{name} shape {x.shape} must be [{tokens}, {top_k}]")
    group = 1
    for axis in dispatcher.axis_names:
        group *= jax.lax.axis_size(axis)
    if group != dispatcher.ep_size:
        raise ValueError(
            f"dispatcher.ep_size={dispatcher.ep_size} but the mesh axes "
            f"{dispatcher.axis_names} hold {group} devices"
        )


def _assign_peer_slots(dispatcher, topk_ids, num_valid_tokens):
    ep_size, capacity = dispatcher.ep_size, dispatcher.peer_capacity
    ids = topk_ids.astype(jnp.int32)
    is_token = jnp.arange(dispatcher.num_tokens, dtype=jnp.int32)[:, None] < num_valid_tokens
    routed = (is_token & (ids >= 0) & (ids < dispatcher.num_experts)).reshape(-1)
    peer = jnp.where(routed, _div(ids.reshape(-1), dispatcher.num_local_experts), ep_size)
    rank = rows_lib.rank_within_group(peer, ep_size)
    kept = routed & (rank < capacity)
    send_slot = jnp.where(kept, peer * capacity + rank, -1)
    send_counts = jnp.sum(
        kept[:, None] & (peer[:, None] == jnp.arange(ep_size)[None, :]), axis=0, dtype=jnp.int32
    )
    peer_overflow = jnp.sum(routed & ~kept, dtype=jnp.int32)
    return send_slot.reshape(ids.shape), send_counts, peer_overflow, _peak(rank, routed)


def _peak(rank, counted):
    """The largest group size: one more than the largest rank among ``counted`` items."""
    return jnp.max(jnp.where(counted, rank + 1, 0), initial=0).astype(jnp.int32)


def _div(value, divisor: int):
    """``value // divisor`` for the non-negative entries that are read.

    Divided as uint32: a constant unsigned division is a shift or a multiply, where int32
    ``//`` (and even truncating ``lax.div``) adds sign corrections. XLA fuses this index
    arithmetic into the row gathers that read it and redoes it for every element of every
    row (docs/benchmarks/, "TBO step cost on one H200", decode-sized children and unsigned EP
    indices).
    """
    quotient = jax.lax.div(value.astype(jnp.uint32), jnp.uint32(divisor))
    return quotient.astype(jnp.int32)


def _fill_send_buffer(dispatcher, hidden_states, topk_ids, send_slot):
    num_slots = dispatcher.ep_size * dispatcher.peer_capacity
    assignment = slot_rows.invert_slots(send_slot.reshape(-1), num_slots)
    token = jnp.where(assignment >= 0, _div(assignment, dispatcher.top_k), -1)
    send_hidden = slot_rows.gather_rows(hidden_states, token)
    # Read only for routed assignments, whose ids are in [0, num_experts).
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    local_expert = ids - _div(ids, dispatcher.num_local_experts) * dispatcher.num_local_experts
    send_expert = jnp.where(assignment >= 0, local_expert[jnp.maximum(assignment, 0)], -1)
    return send_hidden, send_expert


def _send(dispatcher, payload, send_counts, empty_payload) -> peer_copy.InFlight:
    """Issues the exchange of ``payload``'s peer blocks; ``_finish`` gives its result.

    Dense and peer copy: every slot of every block. Ragged: only each block's ``send_counts``
    filled rows; received rows land in ``empty_payload()`` (built only then), whose rows stay
    where nothing arrived.
    """
    if dispatcher.exchange == "peer_copy":
        return peer_copy.all_to_all_start(payload, dispatcher.device_group, dispatcher.platform)
    if dispatcher.exchange == "dense":
        return peer_copy.InFlight(received=_all_to_all(dispatcher, payload), sent=None)
    recv_counts = _all_to_all(dispatcher, send_counts)
    received = _ragged_exchange(dispatcher, payload, send_counts, recv_counts, empty_payload())
    return peer_copy.InFlight(received=received, sent=None)


def _send_back(dispatcher, back, recv_counts, send_counts) -> peer_copy.InFlight:
    """The return exchange of ``_send``: roles reversed, rows nothing came back for are zero."""
    if dispatcher.exchange != "ragged":
        return _send(dispatcher, back, recv_counts, None)
    received = _ragged_exchange(dispatcher, back, recv_counts, send_counts, jnp.zeros_like(back))
    return peer_copy.InFlight(received=received, sent=None)


def _finish(dispatcher, in_flight: peer_copy.InFlight) -> jax.Array:
    """The received rows of ``_send`` or ``_send_back``: waits for a peer copy, else XLA's
    exchange result (XLA places its own wait)."""
    if dispatcher.exchange == "peer_copy":
        return peer_copy.all_to_all_wait(in_flight, dispatcher.device_group)
    return in_flight.received


def checked_expert_outputs(dispatcher, expert_outputs):
    """``expert_outputs`` (``[num_local_experts, C, H_out]`` or ``SlotRows`` standing for
    it), once its shape is the slot layout's.

    ``C`` is the dispatcher's ``expert_capacity``, or more where the outputs are a joint
    grouped GEMM's over two micro-batches' slots (``slot_rows.concat_slots``; the state's
    ``recv_expert_slot`` then counts in those slots, ``slot_rows.move_slots``).

    Raises:
      ValueError: another shape.
    """
    num_local, capacity = dispatcher.num_local_experts, dispatcher.expert_capacity
    shape = tuple(expert_outputs.shape)
    if len(shape) != 3 or shape[0] != num_local or shape[1] < capacity:
        raise ValueError(
            f"expert_outputs shape {shape} must be [{num_local}, C >= {capacity}, H_out]"
        )
    return expert_outputs


def _all_to_all(dispatcher, x):
    """Block ``p`` of ``x`` goes to device ``p``; block ``s`` of the result came from ``s``."""
    return jax.lax.all_to_all(x, dispatcher.axis_names, 0, 0, tiled=True)


def _ragged_exchange(dispatcher, operand, send_sizes, recv_sizes, output):
    """Moves only the filled leading rows of each peer block into ``output``'s block layout.

    ``output`` is what rows not received keep.
    """
    block = dispatcher.peer_capacity
    peers = jnp.arange(dispatcher.ep_size, dtype=jnp.int32)
    me = jax.lax.axis_index(dispatcher.axis_names).astype(jnp.int32)
    return jax.lax.ragged_all_to_all(
        operand,
        output,
        peers * block,  # input_offsets: my block for peer p
        send_sizes.astype(jnp.int32),
        jnp.full_like(peers, me * block),  # output_offsets: my block in each peer's buffer
        recv_sizes.astype(jnp.int32),
        axis_name=dispatcher.axis_names,
    )
