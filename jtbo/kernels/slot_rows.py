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

The rows may come from two sources, numbered as if one followed the other (``rows`` first,
then ``second_rows``), with no concatenation ever built: a peer-copy EP exchange leaves its
own block of the receive buffer unwritten, and the slots of that block name rows of the send
buffer instead (``jtbo.collectives.ep_dispatch``). And a slot's row may be only the leading
``width`` columns of its source row: the EP exchanges' rows carry expert ids (and weights) in
trailing columns, which the experts do not read, and slicing them off would copy every row.
"""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotRows:
    """``[E, C, H]`` capacity slots given as source rows and one row index per slot.

    Slot ``(e, c)`` holds the first ``H`` columns of source row ``slot_row[e, c]``: row ``i <
    N`` of ``rows``, row ``i - N`` of ``second_rows`` for ``i >= N``, zeros for -1.
    """

    rows: jax.Array  # [N, W] the rows the slots hold (their first H columns)
    slot_row: jax.Array  # [E, C] int32 source row of each slot (N + j: second_rows[j]), -1 empty
    second_rows: jax.Array | None = None  # [M, W'] rows numbered after ``rows``, or None
    # H: the columns of a source row that are the slot's row (None: all of ``rows``' columns).
    width: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, C, H)``: the shape of the slot buffer these slots stand for."""
        width = self.rows.shape[1] if self.width is None else self.width
        return tuple(self.slot_row.shape) + (width,)

    @property
    def dtype(self) -> jnp.dtype:
        """The rows' dtype."""
        return self.rows.dtype

    def materialize(self) -> jax.Array:
        """The ``[E, C, H]`` slot buffer: each slot's source row, zero in empty slots."""
        index = jnp.asarray(self.slot_row).reshape(-1)
        width = self.shape[2]
        first = jnp.asarray(self.rows)[:, :width]
        if self.second_rows is None:
            return gather_rows(first, index).reshape(self.shape)
        second = jnp.asarray(self.second_rows)[:, :width]
        return gather_rows_of_two(first, second, index).reshape(self.shape)


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


def gather_rows_of_two(first: jax.Array, second: jax.Array, index: jax.Array) -> jax.Array:
    """``concatenate([first, second])[index]`` row by row, zero where ``index < 0``, without
    building the concatenation.

    Each output row reads one source; the other's gather reads row 0 (a cache hit), so the
    rows are read about once.

    Args:
      first: ``[N, ...]`` rows numbered ``0 .. N - 1``.
      second: ``[M, ...]`` rows numbered ``N .. N + M - 1`` (``first``'s trailing shape and
        dtype).
      index: ``[...]`` int32 row per output row, in ``[0, N + M)`` or -1.

    Returns:
      ``index.shape + first.shape[1:]`` in ``first.dtype``.
    """
    num_first = first.shape[0]
    in_second = index >= num_first
    from_first = gather_rows(first, jnp.where(in_second, -1, index))
    from_second = gather_rows(second, jnp.where(in_second, index - num_first, -1))
    in_second = in_second.reshape(index.shape + (1,) * (first.ndim - 1))
    return jnp.where(in_second, from_second, from_first)
