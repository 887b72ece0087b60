"""Expert capacity slots that name their rows instead of holding copies of them.

An EP dispatch receives token rows and lays them into ``[E, C, H]`` capacity slots (expert
``e``'s rows in its first slots, zeros after). Writing that buffer is a full pass over
``E * C * H`` values, most of it padding at a capacity factor above 1, and the grouped GEMM
then reads the live slots once more. ``SlotRows`` keeps the received rows and, per slot, the
index of the row it holds: the Pallas grouped GEMM (``jtbo.kernels.grouped_gemm``) loads the
rows through that index, so no slot buffer is ever written. ``materialize`` is the slot
buffer itself, for the XLA einsum path, the references and the tests. ``invert_slots`` and
``gather_rows`` are the two steps every slot layout here is built with (the EP exchanges'
send and receive buffers too): which item fills each slot, then the rows by index.
"""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotRows:
    """``[E, C, H]`` capacity slots given as source rows and one row index per slot."""

    rows: jax.Array  # [N, H] the rows the slots hold
    slot_row: jax.Array  # [E, C] int32 row of ``rows`` in each slot, -1 for an empty slot

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, C, H)``: the shape of the slot buffer these slots stand for."""
        return self.slot_row.shape + self.rows.shape[1:]

    @property
    def dtype(self) -> jnp.dtype:
        """The rows' dtype."""
        return self.rows.dtype

    def materialize(self) -> jax.Array:
        """The ``[E, C, H]`` slot buffer: ``rows[slot_row]``, zero in empty slots."""
        index = jnp.asarray(self.slot_row).reshape(-1)
        return gather_rows(jnp.asarray(self.rows), index).reshape(self.shape)


def invert_slots(slot_of_item: jax.Array, num_slots: int) -> jax.Array:
    """Which item fills each slot.

    Args:
      slot_of_item: ``[items]`` int32 slot of each item, -1 for an item that takes none.
      num_slots: slots in all.

    Returns:
      ``[num_slots]`` int32 item filling each slot, -1 for an empty slot.
    """
    items = jnp.arange(slot_of_item.shape[0], dtype=jnp.int32)
    target = jnp.where(slot_of_item >= 0, slot_of_item, num_slots)  # num_slots: dropped
    return jnp.full((num_slots,), -1, jnp.int32).at[target].set(items, mode="drop")


def gather_rows(source: jax.Array, index: jax.Array) -> jax.Array:
    """``source[index]`` row by row, zero where ``index < 0``.

    Args:
      source: ``[N, ...]`` rows.
      index: ``[...]`` int32 row of ``source`` per output row, in range or -1.

    Returns:
      ``index.shape + source.shape[1:]`` in ``source.dtype``.
    """
    # Indices are in range by construction: no bounds check in every element of the row.
    rows = source.at[jnp.maximum(index, 0)].get(mode="promise_in_bounds")
    present = (index >= 0).reshape(index.shape + (1,) * (source.ndim - 1))
    return jnp.where(present, rows, jnp.zeros((), source.dtype))


def flat_slot_source(slots: "jax.Array | SlotRows", flat_slot: jax.Array):
    """Where flat slots ``e * C + j`` read from: ``(rows [N, H], row index [...])``.

    Args:
      slots: ``[E, C, H]`` slot buffer (its rows flattened, the flat slot its own index), or
        ``SlotRows`` (its rows, and each flat slot's row index looked up).
      flat_slot: ``[...]`` int32 flat slot per output row, in ``[0, E * C)`` or -1.

    Returns:
      The rows and an int32 row index per output row, -1 for a zero row.
    """
    if not isinstance(slots, SlotRows):
        return slots.reshape((-1,) + slots.shape[2:]), flat_slot
    index = slots.slot_row.reshape(-1).astype(jnp.int32)
    return slots.rows, jnp.where(flat_slot >= 0, index[jnp.maximum(flat_slot, 0)], -1)


def take_flat(slots: "jax.Array | SlotRows", flat_slot: jax.Array) -> jax.Array:
    """The rows of flat slots ``e * C + j``, zero for -1.

    Args:
      slots: ``[E, C, H]`` slot buffer, or ``SlotRows`` standing for one (a slot whose row
        index is -1 reads as zero).
      flat_slot: ``[...]`` int32 flat slot per output row, in ``[0, E * C)`` or -1.

    Returns:
      ``flat_slot.shape + (H,)`` in the slots' dtype.
    """
    rows, row = flat_slot_source(slots, flat_slot)
    if isinstance(slots, SlotRows):
        # The barrier keeps the looked-up index out of the row gather's fusion: XLA otherwise
        # recomputes it (and what it derives from) for every element of every row, which
        # made the gather many times slower (docs/benchmarks/, "the grouped FFN on Mosaic GPU").
        row = jax.lax.optimization_barrier(row)
    return gather_rows(rows, row)


def take_slots(slots: "jax.Array | SlotRows", expert: jax.Array, position: jax.Array):
    """Slot ``(expert, position)``'s row for each pair, zero for a slot out of range.

    Args:
      slots: ``[E, C, H]`` slot buffer or ``SlotRows`` (``take_flat``).
      expert: ``[...]`` int expert of each pair (out of range: a zero row).
      position: ``[...]`` int slot within the expert (out of range: a zero row).

    Returns:
      ``expert.shape + (H,)`` in the slots' dtype.
    """
    num_experts, capacity = slots.shape[:2]
    inside = (expert >= 0) & (expert < num_experts) & (position >= 0) & (position < capacity)
    flat = jnp.where(inside, expert * capacity + position, -1).astype(jnp.int32)
    return take_flat(slots, flat)


def concat_slots(first: SlotRows, first_counts: jax.Array, second: SlotRows) -> SlotRows:
    """Both slot sets as one, each expert's rows of ``first`` followed by those of ``second``.

    Two micro-batches' expert slots over the same experts become the slots of one grouped GEMM,
    which then reads each expert's weights once for both. Expert ``e``'s rows stay its first
    slots: ``first``'s ``first_counts[e]`` rows, then ``second``'s.

    Args:
      first: ``[E, C1, H]`` slots; expert ``e``'s rows fill its first ``first_counts[e]``.
      first_counts: ``[E]`` int32 rows per expert in ``first``.
      second: ``[E, C2, H]`` slots, rows filled from slot 0 up as in ``first``.

    Returns:
      ``[E, C1 + C2, H]`` slots over ``first.rows`` followed by ``second.rows``.

    Raises:
      ValueError: the slot sets differ in experts or row width.
    """
    if (
        first.slot_row.shape[0] != second.slot_row.shape[0]
        or first.rows.shape[1:] != (second.rows.shape[1:])
    ):
        raise ValueError(f"slot sets {first.shape} and {second.shape} do not concatenate")
    first_capacity, second_capacity = first.slot_row.shape[1], second.slot_row.shape[1]
    slot = jnp.arange(first_capacity + second_capacity, dtype=jnp.int32)[None, :]
    padded = jnp.pad(first.slot_row, ((0, 0), (0, second_capacity)), constant_values=-1)
    in_second = slot - first_counts[:, None].astype(jnp.int32)  # [E, C1 + C2]
    taken = jnp.take_along_axis(
        second.slot_row, jnp.clip(in_second, 0, second_capacity - 1), axis=1
    )
    shifted = jnp.where(taken >= 0, taken + first.rows.shape[0], -1)
    from_second = jnp.where((in_second >= 0) & (in_second < second_capacity), shifted, -1)
    index = jnp.where(in_second < 0, padded, from_second)
    return SlotRows(jnp.concatenate([first.rows, second.rows]), index)


def move_slots(
    flat_slot: jax.Array, capacity: int, new_capacity: int, offset: jax.Array
) -> jax.Array:
    """Flat slot indices of ``[E, capacity]`` slots in ``[E, new_capacity]`` slots, each
    expert's slots moved ``offset[e]`` places on (``concat_slots``: ``offset`` is 0 for the
    first set, the first set's counts for the second).

    Args:
      flat_slot: ``[...]`` int32 ``e * capacity + position``, -1 for none.
      capacity: the slots per expert ``flat_slot`` counts in.
      new_capacity: the slots per expert of the result.
      offset: ``[E]`` int32 places each expert's slots move.

    Returns:
      ``flat_slot``'s shape, int32 ``e * new_capacity + offset[e] + position`` (-1 stays).
    """
    expert, position = flat_slot // capacity, flat_slot % capacity
    moved = expert * new_capacity + offset[jnp.maximum(expert, 0)] + position
    return jnp.where(flat_slot >= 0, moved, -1).astype(jnp.int32)
