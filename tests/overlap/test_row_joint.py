"""Row-wise operations run once over both micro-batches: the same rows as one run per
micro-batch (float64 numpy reference), states left alike, context entries refused."""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jtbo.overlap import operations, row_joint

WEIGHT = np.random.default_rng(0).normal(size=(4, 6))


def _norm_project(state, hidden, residual):
    """A layer-like row-wise op: residual add, a norm, a projection, a popped and a read entry,
    two entries set and an output."""
    summed = hidden + residual + state.pop("bias_rows")
    normed = summed / jnp.sqrt(jnp.mean(summed**2, axis=-1, keepdims=True) + 1e-6)
    state.update(dict(projected=normed @ WEIGHT, pair=(summed, state.scale_rows[:, None] * 2.0)))
    return dict(hidden=normed, residual=summed)


def _reference(hidden, residual, bias, scale):
    summed = hidden + residual + bias
    normed = summed / np.sqrt(np.mean(summed**2, axis=-1, keepdims=True) + 1e-6)
    return normed, summed, normed @ WEIGHT, scale[:, None] * 2.0


def _micro_batch(rng, rows):
    values = [rng.normal(size=(rows, 4)) for _ in range(3)] + [rng.normal(size=(rows,))]
    return [np.asarray(v, np.float32) for v in values]


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), seed=st.integers(0, 10_000))
def test_joint_run_gives_each_micro_batch_its_own_rows(rows, seed):
    rng = np.random.default_rng(seed)
    batches = [_micro_batch(rng, rows) for _ in range(2)]
    states = []
    for _, _, bias, scale in batches:
        state = operations.OperationState(dict(name="context"))
        state.update(dict(bias_rows=jnp.asarray(bias), scale_rows=jnp.asarray(scale)))
        states.append(state)
    inputs = [dict(hidden=jnp.asarray(b[0]), residual=jnp.asarray(b[1])) for b in batches]
    outputs = row_joint.run_joint(_norm_project, states, inputs)
    for state, output, batch in zip(states, outputs, batches, strict=True):
        normed, summed, projected, doubled = _reference(*(b.astype(np.float64) for b in batch))
        # float32 against float64: a relative bound and an absolute one for entries near 0
        # (a sum of three O(1) values can cancel to a few 1e-3, where float32 rounding of the
        # terms is ~1e-7 absolute).
        close = dict(rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(output, dict(hidden=normed, residual=summed), **close)
        chex.assert_trees_all_close(state.projected, projected, rtol=1e-4, atol=1e-5)
        chex.assert_trees_all_close(state.pair, (summed, doubled), **close)
        assert sorted(state.keys()) == ["pair", "projected", "scale_rows"]  # bias popped


def test_joint_run_refuses_context_reads_and_mismatched_rows():
    def reads_context(state):
        state.out = state.x * state.name

    states = [operations.OperationState(dict(name=2.0)) for _ in range(2)]
    for state in states:
        state.x = jnp.ones((3, 2))
    with pytest.raises(KeyError, match="context entry `name`"):
        row_joint.run_joint(reads_context, states, (None, None))
    with pytest.raises(ValueError, match="one leading row count"):
        row_joint.concat_rows((dict(a=jnp.ones((3,))), dict(a=jnp.ones((4,)))))
    with pytest.raises(ValueError, match="differ from B's"):
        row_joint.run_joint(reads_context, states, (dict(a=jnp.ones(3)), dict(b=jnp.ones(3))))
    with pytest.raises(ValueError, match="needs 6 rows"):
        row_joint.split_rows(jnp.ones((5, 2)), 3)


def _layer(log):
    def scale(state, x):
        log.append("scale")
        return dict(x=x * 3.0)

    def shift(state, x):
        log.append("shift")
        return dict(x=x + state.offset)

    return [
        operations.ExecutionOperation("scale", scale, row_wise=True),
        operations.ExecutionOperation("shift", shift),  # reads a context entry
        operations.YieldOperation(),
    ]


@pytest.mark.parametrize("join", [False, True])
def test_lockstep_joins_row_wise_operations_only_when_asked(join):
    log = []
    ops = _layer(log)
    x_a, x_b = (jax.random.normal(jax.random.key(i), (4, 3)) for i in range(2))
    out = operations.execute_lockstep_operations(
        [dict(x=x_a), dict(x=x_b)], [ops, ops], join_row_wise=join,
        contexts_arr=(dict(offset=1.0), dict(offset=-2.0)),
    )  # fmt: skip
    assert log == (["scale"] if join else ["scale", "scale"]) + ["shift", "shift"]
    for got, x, offset in zip(out, (x_a, x_b), (1.0, -2.0), strict=True):
        chex.assert_trees_all_close(got["x"], np.asarray(x) * 3.0 + offset, rtol=1e-6)
