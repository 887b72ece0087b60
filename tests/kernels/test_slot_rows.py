"""SlotRows: the slot buffer its rows and row index stand for."""

import jax.numpy as jnp
import numpy as np

from jtbo import kernels
from jtbo.kernels import slot_rows


def test_materialize_gathers_rows_and_zeros_empty_slots():
    rows = np.random.default_rng(3).standard_normal((6, 5)).astype(np.float32)
    slot_row = np.array([[4, -1, 0], [5, 5, -1]], np.int32)
    slots = kernels.SlotRows(rows=jnp.asarray(rows), slot_row=jnp.asarray(slot_row))
    want = np.stack([rows[[4, 0, 0]], rows[[5, 5, 0]]])
    want[0, 1] = want[1, 2] = 0.0  # the empty slots
    np.testing.assert_array_equal(np.asarray(slots.materialize()), want)
    assert slots.shape == (2, 3, 5) and slots.dtype == jnp.float32


def test_materialize_takes_host_arrays():
    rows = np.arange(12, dtype=np.float32).reshape(4, 3) + 1.0
    slots = kernels.SlotRows(rows=rows, slot_row=np.array([[3, 1]], np.int32))
    np.testing.assert_array_equal(np.asarray(slots.materialize()), rows[[3, 1]][None])


def test_invert_slots_names_each_slots_item_and_gather_rows_reads_them():
    rng = np.random.default_rng(8)
    slot_of_item = rng.permutation(10)[:7].astype(np.int32)  # 7 items in distinct slots
    slot_of_item[[1, 4]] = -1  # two items take no slot
    got = np.asarray(slot_rows.invert_slots(jnp.asarray(slot_of_item), 10))
    want = np.full(10, -1)
    for item, slot in enumerate(slot_of_item):
        if slot >= 0:
            want[slot] = item
    np.testing.assert_array_equal(got, want)
    source = rng.standard_normal((7, 3)).astype(np.float32) + 5.0
    rows = np.asarray(slot_rows.gather_rows(jnp.asarray(source), jnp.asarray(got)))
    np.testing.assert_array_equal(rows, np.where(want[:, None] >= 0, source[want], 0.0))
