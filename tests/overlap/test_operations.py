"""Stage cutting, the staggered order, state rules and round barriers."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.overlap import operations


def _recording_ops(log, num_stages, ops_per_stage=2):
    ops = []
    for stage in range(num_stages):
        for index in range(ops_per_stage):

            def op(state, tag=None, _s=stage, _i=index):
                log.append((tag, _s, _i))
                return dict(tag=tag)

            ops.append(op)
        ops.append(operations.YieldOperation())
    return ops


def _expected_order(num_stages, delta):
    a = [("a", s) for s in range(num_stages)]
    b = [("b", s) for s in range(num_stages)]
    order = a[:delta]
    for i in range(num_stages - delta):
        order += [a[delta + i], b[i]]
    return order + b[num_stages - delta :]


@pytest.mark.parametrize("delta", [0, 1, 2])
def test_overlapped_order_is_sglangs(delta):
    log = []
    num_stages = 5
    ops = _recording_ops(log, num_stages)
    outputs = operations.execute_overlapped_operations(
        [dict(tag="a"), dict(tag="b")], [ops, ops], [0, delta]
    )
    stages_seen = [(tag, stage) for tag, stage, index in log if index == 0]
    assert stages_seen == _expected_order(num_stages, delta)
    # within a stage, the operations run in order and back to back
    assert all(log[2 * i][:2] == log[2 * i + 1][:2] for i in range(len(log) // 2))
    assert outputs == [dict(tag="a"), dict(tag="b")]


@settings(max_examples=20, deadline=None)
@given(num_stages=st.integers(1, 7), data=st.data())
def test_every_stage_runs_once_per_micro_batch(num_stages, data):
    delta = data.draw(st.integers(0, num_stages))
    log = []
    ops = _recording_ops(log, num_stages, ops_per_stage=1)
    operations.execute_overlapped_operations([dict(tag="a"), dict(tag="b")], [ops, ops], [0, delta])
    assert [(t, s) for t, s, _ in log] == _expected_order(num_stages, delta)


def test_stage_cutting_and_empty_stage():
    def f(state):
        return None

    y = operations.YieldOperation()
    assert [len(s) for s in operations.convert_operations_to_stages([f, f, y, f, y])] == [2, 1]
    assert operations.convert_operations_to_stages([f])[0][0].debug_name == "f"
    with pytest.raises(ValueError, match="empty"):
        operations.convert_operations_to_stages([f, y, y, f])
    with pytest.raises(ValueError, match="empty"):
        operations.convert_operations_to_stages([y, f])
    with pytest.raises(ValueError, match="callable"):
        operations.convert_operations_to_stages([f, 3])


def test_bad_overlap_arguments():
    def f(state):
        return None

    with pytest.raises(ValueError, match="delta_stages\\[0\\]"):
        operations.execute_overlapped_operations([{}, {}], [[f], [f]], [1, 0])
    with pytest.raises(ValueError, match="outside"):
        operations.execute_overlapped_operations([{}, {}], [[f], [f]], [0, 2])
    with pytest.raises(ValueError, match="stage counts differ"):
        operations.execute_overlapped_operations(
            [{}, {}], [[f], [f, operations.YieldOperation(), f]], [0, 0]
        )
    with pytest.raises(ValueError, match="2 micro-batches"):
        operations.execute_overlapped_operations([{}], [[f], [f]], [0, 0])


def test_state_rules():
    state = operations.OperationState(context=dict(meta="m"))
    state.x = 1
    with pytest.raises(KeyError, match="already exists"):
        state.x = 2
    with pytest.raises(KeyError, match="read-only"):
        state.meta = 3
    assert state.meta == "m" and "x" in state and state.get("nope", 7) == 7
    with pytest.raises(AttributeError, match="no key"):
        _ = state.nope
    assert state.pop("x") == 1
    state.x = 5  # allowed again after pop
    state.y = 6
    with pytest.raises(KeyError, match="unexpected state keys"):
        state.clear(expect_keys=["x"])
    state.clear(expect_keys=["x", "y"])
    assert state.keys() == [] and state.meta == "m"  # context survives clear
    with pytest.raises(KeyError):
        state.pop("meta")


def test_contexts_are_per_micro_batch():
    seen = []

    def op(state):
        seen.append(state.which)

    operations.execute_overlapped_operations(
        [{}, {}], [[op], [op]], [0, 0], contexts_arr=[dict(which="A"), dict(which="B")]
    )
    assert seen == ["A", "B"]


def _barrier_operands(jaxpr):
    return [len(e.invars) for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]


def test_barriers_leave_in_flight_values_out():
    def issue(state, x):
        state.pending = operations.InFlight(x * 2)  # stands for a collective's result
        state.kept = x + 1
        return None

    def consume(state):
        return dict(x=state.pop("pending").value + state.pop("kept"))

    ops = [issue, operations.YieldOperation(), consume]

    def run(a, b, barriers):
        outs = operations.execute_overlapped_operations(
            [dict(x=a), dict(x=b)], [ops, ops], [0, 0], barriers=barriers
        )
        return outs[0]["x"], outs[1]["x"]

    a, b = jnp.arange(3.0), jnp.ones(3)
    jaxpr = jax.make_jaxpr(lambda a, b: run(a, b, True))(a, b).jaxpr
    # round 1 pins only the two `kept` arrays; round 2 pins the two outputs
    assert _barrier_operands(jaxpr) == [2, 2]
    assert _barrier_operands(jax.make_jaxpr(lambda a, b: run(a, b, False))(a, b).jaxpr) == []
    got = jax.jit(lambda a, b: run(a, b, True))(a, b)
    assert jnp.allclose(got[0], 3 * a + 1) and jnp.allclose(got[1], 3 * b + 1)


def test_named_scopes_mark_micro_batches():
    def op_square(state, x):
        return dict(x=x * x)

    def run(a, b):
        outs = operations.execute_overlapped_operations(
            [dict(x=a), dict(x=b)], [[op_square], [op_square]], [0, 0]
        )
        return outs[0]["x"], outs[1]["x"]

    text = jax.jit(run).lower(jnp.ones(2), jnp.ones(2)).as_text(debug_info=True)
    assert "tbo_a/square" in text and "tbo_b/square" in text


def _issue_consume_ops():
    """``x -> *_a`` issues (``InFlight``), ``*_b`` consumes after the yield."""

    def work(state, x):
        return dict(x=jnp.sin(x) * 3.0)

    def exchange_a(state, x):
        state.pending = operations.InFlight(x[::-1] * 2.0)  # stands for a collective
        state.kept = x + 1.0
        return None

    def exchange_b(state):
        return dict(x=state.pop("pending").value - state.pop("kept"))

    issue = operations.IssuingOperation(exchange_a)
    layer = [work, issue, operations.YieldOperation(), exchange_b, work]
    return 2 * (layer + [operations.YieldOperation()])  # two layers


@pytest.mark.parametrize("delta", [0, 1])
def test_issue_barriers_pin_before_every_issuing_op_and_change_no_number(delta):
    ops = _issue_consume_ops()

    def run(a, b, issue_barriers):
        outs = operations.execute_overlapped_operations(
            [dict(x=a), dict(x=b)], [ops, ops], [0, delta], issue_barriers=issue_barriers
        )
        return outs[0]["x"], outs[1]["x"]

    keys = jax.random.split(jax.random.key(delta), 2)
    a, b = (jax.random.normal(k, (5,)) for k in keys)
    pinned = jax.make_jaxpr(lambda a, b: run(a, b, True))(a, b).jaxpr
    # one barrier before each `exchange_a` but B's last (A has nothing left to issue then)
    assert len(_barrier_operands(pinned)) == 3
    assert _barrier_operands(jax.make_jaxpr(lambda a, b: run(a, b, False))(a, b).jaxpr) == []
    got = jax.jit(lambda a, b: run(a, b, True))(a, b)
    want = run(a, b, False)
    for g, w, x in zip(got, want, (a, b), strict=True):
        y = np.sin(np.asarray(x, np.float64)) * 3.0
        y = np.sin(y[::-1] * 2.0 - (y + 1.0)) * 3.0
        y = np.sin(y) * 3.0
        reference = np.sin(y[::-1] * 2.0 - (y + 1.0)) * 3.0
        np.testing.assert_allclose(g, reference, rtol=1e-5, atol=1e-5)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(g, w)
        else:  # a GPU's fused kernels contract a * 2 - b into an FMA, op-by-op ones do not
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=0)


def test_issue_barrier_pins_the_other_micro_batchs_in_flight_result():
    ops = _issue_consume_ops()
    x = jnp.arange(4.0)
    jaxpr = jax.make_jaxpr(
        lambda a, b: operations.execute_overlapped_operations(
            [dict(x=a), dict(x=b)], [ops, ops], [0, 0], issue_barriers=True
        )
    )(x, x + 1).jaxpr
    # delta 0: A's first issue pins its stage input and B's initial input (2); B's first issue
    # pins its stage input and A's pending and kept values (3: the in-flight one included);
    # A's second issue pins its stage input and B's layer output (2: B's exchange was
    # consumed); B's second issue is not pinned (A has nothing left to issue)
    assert _barrier_operands(jaxpr) == [2, 3, 2]


def test_pin_issued_pins_every_issued_exchange_with_the_other_micro_batch():
    ops = _issue_consume_ops()
    keys = jax.random.split(jax.random.key(7), 2)
    a, b = (jax.random.normal(k, (5,)) for k in keys)

    def run(a, b, pin_issued):
        outs = operations.execute_overlapped_operations(
            [dict(x=a), dict(x=b)], [ops, ops], [0, 0], pin_issued=pin_issued
        )
        return outs[0]["x"], outs[1]["x"]

    jaxpr = jax.make_jaxpr(lambda a, b: run(a, b, True))(a, b).jaxpr
    # After each of the four `exchange_a` ops (two per micro-batch, the last ones included),
    # one barrier over both micro-batches' live arrays, in-flight values included: at least
    # the issuer's pending and kept values and one array of the other micro-batch
    operands = _barrier_operands(jaxpr)
    assert len(operands) == 4 and min(operands) >= 3, operands
    got, want = jax.jit(lambda a, b: run(a, b, True))(a, b), run(a, b, False)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


def _joint_layer(log):
    """``double`` has a joint form; ``scale`` and ``shift`` do not."""

    def scale(state, x):
        log.append(("scale", state.name))
        return dict(x=x * 3.0)

    def double(state, x):
        log.append(("double", state.name))
        return dict(x=x * 2.0)

    def double_joint(states, inputs):
        log.append(("double", "joint"))
        both = jnp.concatenate([inputs[0]["x"], inputs[1]["x"]]) * 2.0
        first = inputs[0]["x"].shape[0]
        return dict(x=both[:first]), dict(x=both[first:])

    def shift(state, x):
        log.append(("shift", state.name))
        return dict(x=x + 1.0)

    joint = operations.JointOperation(double, double_joint)
    return [
        operations.ExecutionOperation("scale", scale),
        operations.YieldOperation(),
        operations.ExecutionOperation("double", joint.fn, joint.joint_fn),
        operations.ExecutionOperation("shift", shift),
    ]


def test_lockstep_runs_each_operation_for_a_then_b_and_joint_ones_once():
    log, ops = [], None
    ops = _joint_layer(log)
    x_a, x_b = (jax.random.normal(jax.random.key(i), (n, 4)) for i, n in ((0, 3), (1, 5)))
    out = operations.execute_lockstep_operations(
        [dict(x=x_a), dict(x=x_b)], [ops, ops], contexts_arr=(dict(name="a"), dict(name="b"))
    )
    assert log == [
        ("scale", "a"), ("scale", "b"), ("double", "joint"), ("shift", "a"), ("shift", "b")
    ]  # fmt: skip
    for got, x in zip(out, (x_a, x_b), strict=True):
        chex.assert_trees_all_close(got["x"], np.asarray(x) * 6.0 + 1.0, rtol=1e-6)
    # The staggered executor never takes the joint form.
    log.clear()
    staggered = operations.execute_overlapped_operations(
        [dict(x=x_a), dict(x=x_b)],
        [ops, ops],
        [0, 1],
        contexts_arr=(dict(name="a"), dict(name="b")),
    )
    assert ("double", "joint") not in log and ("double", "a") in log and ("double", "b") in log
    chex.assert_trees_all_close(staggered, out)


def test_lockstep_refuses_micro_batches_with_different_operations():
    log = []
    ops = _joint_layer(log)
    with pytest.raises(ValueError, match="same operations"):
        operations.execute_lockstep_operations([dict(x=1.0), dict(x=1.0)], [ops, ops[:-1]])
    with pytest.raises(ValueError, match="2 micro-batches"):
        operations.execute_lockstep_operations([dict(x=1.0)], [ops, ops])


def test_lockstep_round_barriers_pin_each_stage_and_change_no_number():
    log = []
    ops = _joint_layer(log)  # two stages
    x_a, x_b = (jax.random.normal(jax.random.key(i), (n, 4)) for i, n in ((2, 3), (3, 2)))

    def run(barriers):
        out = operations.execute_lockstep_operations(
            [dict(x=x_a), dict(x=x_b)], [ops, ops], barriers=barriers,
            contexts_arr=(dict(name="a"), dict(name="b")),
        )  # fmt: skip
        return [o["x"] for o in out]

    jaxpr = str(jax.make_jaxpr(lambda: run(True))())
    assert jaxpr.count("optimization_barrier") == 2 and "optimization_barrier" not in str(
        jax.make_jaxpr(lambda: run(False))()
    )
    chex.assert_trees_all_close(run(True), run(False))


def test_a_state_with_declared_entries_refuses_any_other_name():
    class Declared(operations.OperationState):
        x: int  # the one entry

    state = Declared(context=dict(meta="m"))
    state.x = 1
    for misspelt in (lambda: setattr(state, "y", 2), lambda: state.pop("y"), lambda: state.y):
        with pytest.raises(AttributeError, match="no entry of Declared"):
            misspelt()
    assert state.meta == "m" and state.pop("x") == 1
    with pytest.raises(KeyError, match="declared entries"):
        Declared(context=dict(x=3))
