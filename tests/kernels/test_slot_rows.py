"""SlotRows: the slot buffer its rows and row index stand for."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _filled_slots(rng, experts, capacity, num_rows):
    """Random slots: expert ``e``'s first ``counts[e]`` name rows of ``num_rows``, -1 after."""
    counts = rng.integers(0, capacity + 1, experts).astype(np.int32)
    slot_row = rng.integers(0, num_rows, (experts, capacity)).astype(np.int32)
    slot_row[np.arange(capacity)[None, :] >= counts[:, None]] = -1
    return counts, slot_row


# Jitted once per example's shapes: eagerly, each of their operations compiled for every new
# shape the examples draw.
_concat_slots = jax.jit(slot_rows.concat_slots)
_materialize = jax.jit(slot_rows.SlotRows.materialize)
_move_slots = jax.jit(slot_rows.move_slots, static_argnums=(1, 2))


@settings(max_examples=40, deadline=None)
@given(
    experts=st.integers(1, 5), first_capacity=st.integers(1, 6), second_capacity=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_concat_slots_puts_each_experts_second_rows_after_its_first(
    experts, first_capacity, second_capacity, seed
):
    rng = np.random.default_rng(seed)
    first_rows, second_rows = (rng.standard_normal((n, 3)).astype(np.float32) for n in (7, 4))
    counts_a, index_a = _filled_slots(rng, experts, first_capacity, 7)
    counts_b, index_b = _filled_slots(rng, experts, second_capacity, 4)
    first = slot_rows.SlotRows(jnp.asarray(first_rows), jnp.asarray(index_a))
    second = slot_rows.SlotRows(jnp.asarray(second_rows), jnp.asarray(index_b))
    joint = _concat_slots(first, jnp.asarray(counts_a), second)
    # numpy: per expert, the first set's rows, then the second's, then empty slots.
    rows = np.concatenate([first_rows, second_rows])
    want = np.zeros((experts, first_capacity + second_capacity, 3), np.float32)
    for e in range(experts):
        names = [*index_a[e, : counts_a[e]], *(index_b[e, : counts_b[e]] + 7)]
        want[e, : len(names)] = rows[names]
    np.testing.assert_array_equal(np.asarray(_materialize(joint)), want)
    # Each set's own slot indices, moved, read the same rows out of the joint slots.
    flat = np.asarray(_materialize(joint)).reshape(-1, 3)
    for slots, counts, capacity, offset in (
        (first, counts_a, first_capacity, np.zeros_like(counts_a)),
        (second, counts_b, second_capacity, counts_a),
    ):
        own = np.arange(experts * capacity).reshape(experts, capacity)
        own = np.where(np.arange(capacity)[None] < counts[:, None], own, -1).reshape(-1)
        own[rng.random(own.shape) < 0.2] = -1  # some items take no slot
        moved = np.asarray(
            _move_slots(jnp.asarray(own), capacity, joint.shape[1], jnp.asarray(offset))
        )
        assert np.all((moved >= 0) == (own >= 0))
        got = np.where(moved[:, None] >= 0, flat[np.maximum(moved, 0)], 0.0)
        ref = np.asarray(_materialize(slots)).reshape(-1, 3)
        np.testing.assert_array_equal(got, np.where(own[:, None] >= 0, ref[np.maximum(own, 0)], 0))


def test_concat_slots_refuses_sets_of_other_experts():
    a = slot_rows.SlotRows(jnp.zeros((2, 3)), jnp.zeros((2, 1), jnp.int32))
    b = slot_rows.SlotRows(jnp.zeros((2, 3)), jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(ValueError, match="do not concatenate"):
        slot_rows.concat_slots(a, jnp.zeros((2,), jnp.int32), b)


def test_take_slots_reads_the_same_rows_from_a_buffer_and_from_slot_rows():
    rows = jax.random.normal(jax.random.key(0), (6, 3), jnp.float32)
    slot_row = jnp.array([[4, 0, -1], [2, -1, -1]], jnp.int32)
    slots = slot_rows.SlotRows(rows, slot_row)
    expert = jnp.array([[0, 1], [1, 2], [0, 0]], jnp.int32)  # expert 2 is out of range
    position = jnp.array([[1, 0], [1, 0], [0, 2]], jnp.int32)
    got = slot_rows.take_slots(slots, expert, position)
    chex.assert_trees_all_close(got, slot_rows.take_slots(slots.materialize(), expert, position))
    np.testing.assert_array_equal(np.asarray(got[0, 0]), np.asarray(rows[0]))
    assert not np.asarray(got[1]).any() and not np.asarray(got[2, 1]).any()
