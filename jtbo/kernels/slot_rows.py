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
