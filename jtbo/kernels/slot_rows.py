"""Expert capacity slots that name their rows instead of holding copies of them.

An EP dispatch receives token rows and lays them into ``[E, C, H]`` capacity slots (expert
``e``'s rows in its first slots, zeros after). Writing that buffer is a full pass over
``E * C * H`` values, most of it padding at a capacity factor above 1, and the grouped GEMM
then reads the live slots once more. ``SlotRows`` keeps the received rows and, per slot, the
index of the row it holds: the Pallas grouped GEMM (``jtbo.kernels.grouped_gemm``) loads the
rows through that index, so no slot buffer is ever written. ``materialize`` is the slot
buffer itself, for the XLA einsum path, the references and the tests.
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
        rows, index = jnp.asarray(self.rows), jnp.asarray(self.slot_row).reshape(-1)
        # In range by construction (an index is a row number or -1): no bounds checks.
        gathered = rows.at[jnp.maximum(index, 0)].get(mode="promise_in_bounds")
        present = (index >= 0)[:, None]
        return jnp.where(present, gathered, jnp.zeros((), rows.dtype)).reshape(self.shape)
