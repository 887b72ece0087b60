"""Operations, stages and the staggered two-micro-batch executor (SGLang ``operations.py``).

A layer is written as a flat list of *operations*: callables ``op(state, **inputs) -> outputs``
where ``inputs`` is the mapping the previous operation returned and ``state`` is a
per-micro-batch scratch space (``operation_state.OperationState``, whose subclasses declare
their entries). ``YieldOperation`` markers cut the list into *stages*.
``execute_operations`` runs one micro-batch through every stage.
``execute_overlapped_operations`` runs two micro-batches A and B staggered: A alone for
``d`` stages, then A and B alternately one stage each, then B alone for its last ``d``
stages. SGLang interleaves CUDA kernel launches that way at run time; in JAX the
interleaving happens while tracing, so both micro-batches become independent dataflow in
one HLO program and XLA's latency-hiding scheduler places one micro-batch's asynchronous
collectives over the other micro-batch's compute.

Every stage of micro-batch A is traced under ``jax.named_scope("tbo_a")`` and every stage of
B under ``"tbo_b"`` (each operation under its own name inside), so the compiled program's
``op_name`` metadata says which micro-batch each instruction belongs to.

Lockstep (``execute_lockstep_operations``). Where nothing is exchanged (a one-device mesh)
staggering has nothing to hide and only costs: each micro-batch runs its own half-size
kernels and reads every weight again. The lockstep executor runs A's and B's operations side
by side, one operation at a time, and an operation that has a joint form (``JointOperation``)
runs it once for both, e.g. the routed experts' grouped GEMM over both micro-batches' rows.
With ``join_row_wise`` an operation marked ``row_wise`` runs once as well, over both
micro-batches' concatenated rows (``row_joint``). Both micro-batches reach each yield
together, so round barriers pin one stage of each.

Round barriers (optional). ``lax.optimization_barrier`` over both micro-batches' live arrays
after every round pins the rounds: nothing of round ``k + 1`` can be hoisted above the
barrier. A barrier must not include the result of a collective that is still in flight
across the yield (an operation with ``issues_collective`` issues it, SGLang's ``*_a``; a later
one, SGLang's ``*_b``, consumes it): that
would force the collective to finish inside its round and undo much of the overlap. An
operation marks such a result by wrapping it in ``InFlight``; the barrier
leaves every ``InFlight`` value out and the consumer unwraps it with ``.value``.

Issue barriers (optional, ``issue_barriers=True``; the model step uses them on multi-device
meshes). Right before an operation that issues a collective (its ``issues_collective``
field; SGLang names such operations ``*_a``, but nothing here reads the name), one
``optimization_barrier`` takes both micro-batches' live arrays, the other micro-batch's
``InFlight`` results included. The collective's input is then ready before the other
micro-batch's next stage starts, and the other's exchange finishes before this one is issued
(XLA:GPU keeps one collective in flight at a time anyway), so each exchange window holds the
other micro-batch's whole next stage instead of whatever XLA's latency estimate would place
there. Once the other micro-batch has no collective left to issue, the barrier is skipped,
so its last stages stay free to fill the remaining windows.
"""

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax import lax

from jtbo.overlap import operation_state, row_joint

OperationState = operation_state.OperationState  # the state type the executors default to
MICRO_BATCH_SCOPES = ("tbo_a", "tbo_b")  # named scopes of micro-batch A and B
JOINT_SCOPE = "tbo_joint"  # named scope of an operation run once for both micro-batches


@dataclasses.dataclass(frozen=True)
class YieldOperation:
    """Marks the end of a stage: the other micro-batch may run its next stage here."""


JointFn = Callable[
    [tuple["OperationState", "OperationState"], tuple[Mapping[str, Any] | None, ...]],
    tuple[Mapping[str, Any] | None, Mapping[str, Any] | None],
]  # joint_fn((state_a, state_b), (inputs_a, inputs_b)) -> (outputs_a, outputs_b)


@dataclasses.dataclass(frozen=True)
class ExecutionOperation:
    """A named operation: ``fn(state, **inputs) -> outputs`` (outputs a mapping or None).

    ``joint_fn``, where given, does the operation's work for both micro-batches at once; only
    the lockstep executor (``execute_lockstep_operations``) calls it. ``row_wise`` marks an
    operation whose every array has the rows as leading axis and whose rows do not mix
    (``row_joint``): the lockstep executor may run it once over both micro-batches' rows.
    """

    debug_name: str  # shown as a named scope in the compiled program's op_name
    fn: Callable[..., Mapping[str, Any] | None]
    joint_fn: JointFn | None = None
    row_wise: bool = False  # rows independent: row_joint.run_joint may run it for both
    # Issues a collective left in flight across its yield (SGLang's ``*_a``): issue barriers
    # and ``pin_issued`` act around it.
    issues_collective: bool = False


@dataclasses.dataclass(frozen=True)
class JointOperation:
    """A layer's operation with a form over both micro-batches at once.

    ``strategy.layer_operations`` turns it into an ``ExecutionOperation`` with ``joint_fn``.
    The joint form must leave each micro-batch's state exactly as ``fn`` run on each would
    (same keys, same values up to the order of floating-point sums).
    """

    fn: Callable[..., Mapping[str, Any] | None]  # one micro-batch: fn(state, **inputs)
    joint_fn: JointFn  # both micro-batches: see ``JointFn``


@dataclasses.dataclass(frozen=True)
class IssuingOperation:
    """A layer's operation that issues a collective left in flight across its yield.

    ``strategy.layer_operations`` turns it into an ``ExecutionOperation`` with
    ``issues_collective``; the result it leaves in the state is wrapped in ``InFlight``.
    """

    fn: Callable[..., Mapping[str, Any] | None]  # one micro-batch: fn(state, **inputs)


Operation = (
    YieldOperation | ExecutionOperation | IssuingOperation | Callable[..., Mapping[str, Any] | None]
)
Stage = list[ExecutionOperation]


@dataclasses.dataclass(frozen=True)
class InFlight:
    """The result of a collective still in flight across a yield; round barriers skip it.

    Not a pytree: it must be unwrapped (``.value``) before jax operations use it.
    """

    value: Any  # the collective's output, any pytree of arrays


def convert_operations_to_stages(operations: Sequence[Operation]) -> list[Stage]:
    """Cuts ``operations`` into stages at every ``YieldOperation``.

    A trailing yield ends the last stage; it does not open an empty one.

    Raises:
      ValueError: a stage would be empty (two yields in a row, or a leading yield).
    """
    stages = list(_chunk_by_yield([_decorate(op) for op in operations]))
    for index, stage in enumerate(stages):
        if not stage:
            raise ValueError(f"stage {index} of {len(stages)} is empty (yields back to back)")
    return stages


def _chunk_by_yield(operations: list) -> Iterator[Stage]:
    pending: Stage = []
    for op in operations:
        if isinstance(op, YieldOperation):
            yield pending
            pending = []
        else:
            pending.append(op)
    if pending:
        yield pending


def _decorate(op: Operation) -> YieldOperation | ExecutionOperation:
    if isinstance(op, YieldOperation | ExecutionOperation):
        return op
    if isinstance(op, IssuingOperation):
        return ExecutionOperation(_debug_name(op.fn), op.fn, issues_collective=True)
    if not callable(op):
        raise ValueError(f"operation {op!r} is neither a YieldOperation nor callable")
    return ExecutionOperation(debug_name=_debug_name(op), fn=op)


def _debug_name(fn: Callable) -> str:
    """A bare callable's scope name: its name without an ``op_`` prefix."""
    return getattr(fn, "__name__", type(fn).__name__).removeprefix("op_")


class _StageExecutor:
    """Runs one micro-batch's stages one at a time under its named scope."""

    def __init__(self, scope: str | None, stages: list[Stage], inputs, context, state_type):
        self.scope = scope
        self.stages = stages
        self.index = 0
        self.state = state_type(context)
        self.stage_output: Mapping[str, Any] | None = inputs

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def done(self) -> bool:
        return self.index >= self.num_stages

    def issues_ahead(self) -> bool:
        """Whether a stage not yet finished holds a collective-issuing operation."""
        return any(op.issues_collective for stage in self.stages[self.index :] for op in stage)

    def next(
        self,
        before_issue: Callable[[], None] | None = None,
        after_issue: Callable[[], None] | None = None,
    ) -> None:
        """Runs the next stage; ``before_issue()`` / ``after_issue()`` run before / after each
        collective-issuing op (``ExecutionOperation.issues_collective``)."""
        if self.done:
            raise RuntimeError(f"executor {self.scope} has no stage left")
        with _maybe_scope(self.scope):
            for op in self.stages[self.index]:
                issues = op.issues_collective
                if before_issue is not None and issues:
                    before_issue()
                with jax.named_scope(op.debug_name):
                    self.stage_output = op.fn(self.state, **(self.stage_output or {}))
                if after_issue is not None and issues:
                    after_issue()
        self.index += 1


def _maybe_scope(scope: str | None):
    return jax.named_scope(scope) if scope else contextlib.nullcontext()


def execute_operations(
    inputs: Mapping[str, Any],
    operations: Sequence[Operation],
    *,
    context: Any = None,
    scope: str | None = None,
    state_type: type[OperationState] = OperationState,
) -> Mapping[str, Any] | None:
    """Runs one micro-batch (or the whole batch) through every stage of ``operations``.

    Args:
      inputs: keyword inputs of the first operation.
      operations: the operation list (yields are ignored apart from cutting stages).
      context: read-only state entries visible to every operation (a mapping or a
        dataclass, ``operation_state``).
      scope: an optional named scope around every stage.
      state_type: the state's class (an ``OperationState`` declaring its entries).

    Returns:
      The last operation's output.
    """
    stages = convert_operations_to_stages(operations)
    executor = _StageExecutor(scope, stages, inputs, context, state_type)
    while not executor.done:
        executor.next()
    return executor.stage_output


def execute_overlapped_operations(
    inputs_arr: Sequence[Mapping[str, Any]],
    operations_arr: Sequence[Sequence[Operation]],
    delta_stages: Sequence[int],
    *,
    contexts_arr: Sequence[Any] = (None, None),
    barriers: bool = False,
    issue_barriers: bool = False,
    pin_issued: bool = False,
    state_type: type[OperationState] = OperationState,
) -> list[Mapping[str, Any] | None]:
    """Runs micro-batches A and B staggered by ``delta_stages[1]`` stages.

    Order (SGLang's): A alone for ``d`` stages; then A, B alternately one stage each; then B
    alone for its last ``d`` stages.

    Args:
      inputs_arr: (inputs of A, inputs of B).
      operations_arr: (operations of A, operations of B); same stage count.
      delta_stages: ``(0, d)``.
      contexts_arr: read-only state entries of A and of B (per-child attention metadata,
        dispatcher, DP context).
      barriers: close every round with an ``optimization_barrier`` over both micro-batches'
        live arrays, leaving out ``InFlight`` values.
      issue_barriers: put the same barrier right before every operation that issues a
        collective (``ExecutionOperation.issues_collective``), so that the collective's input
        is ready before the other micro-batch's next stage starts (see the module docstring).
      pin_issued: put a barrier over both micro-batches' live arrays, in-flight results
        included, right after every issuing operation, so that the exchange it started is
        issued before the other micro-batch's next stage. Only for exchanges with an explicit
        start and wait (``jtbo.collectives.peer_copy``), which the barrier leaves in flight:
        an XLA collective in flight there would be made to finish.
      state_type: the class of both states (an ``OperationState`` declaring its entries).

    Returns:
      [output of A, output of B].

    Raises:
      ValueError: two micro-batches are not given, ``delta_stages[0] != 0``, ``d`` is
        negative or exceeds the stage count, or the stage counts differ.
    """
    _check_pair("delta_stages", delta_stages)
    executors = _pair_executors(inputs_arr, operations_arr, contexts_arr, state_type)
    executor_a, executor_b = executors
    delta = _stagger(executors, delta_stages)
    before_issue = functools.partial(_pin_before_issue, executors) if issue_barriers else None
    after_issue = functools.partial(_pin_round, executors, in_flight=True) if pin_issued else None
    for round_executors in _rounds(executor_a, executor_b, delta):
        for executor in round_executors:
            executor.next(before_issue, after_issue)
        if barriers:
            _pin_round(executors)
    return [executor_a.stage_output, executor_b.stage_output]


def execute_lockstep_operations(
    inputs_arr: Sequence[Mapping[str, Any]],
    operations_arr: Sequence[Sequence[Operation]],
    *,
    contexts_arr: Sequence[Any] = (None, None),
    barriers: bool = False,
    join_row_wise: bool = False,
    state_type: type[OperationState] = OperationState,
) -> list[Mapping[str, Any] | None]:
    """Runs micro-batches A and B operation by operation, joint operations once for both.

    For a mesh with nothing to exchange (one device), where staggering hides nothing: A's
    operation ``i``, then B's, for every ``i``, except that an operation with a ``joint_fn``
    runs once, over both micro-batches' states (e.g. one grouped GEMM over both micro-batches'
    expert rows, which reads each expert weight once). Each micro-batch still runs in its own
    state and scope, so its rows meet only the other's inside a joint operation. Both reach
    each yield together: a round is one stage of each.

    Args:
      inputs_arr: (inputs of A, inputs of B).
      operations_arr: (operations of A, operations of B): the same names in the same stages.
      contexts_arr: read-only state entries of A and of B.
      barriers: close every round with an ``optimization_barrier`` over both micro-batches'
        live arrays, as ``execute_overlapped_operations`` does.
      join_row_wise: also run every ``row_wise`` operation once over both micro-batches' rows
        (``row_joint.run_joint``): where the micro-batches are small, a second launch of each
        small kernel costs more than concatenating their rows.
      state_type: the class of both states (an ``OperationState`` declaring its entries).

    Returns:
      [output of A, output of B].

    Raises:
      ValueError: two micro-batches are not given, or their stages' operation names differ.
    """
    executors = _pair_executors(inputs_arr, operations_arr, contexts_arr, state_type)
    names = [[[op.debug_name for op in stage] for stage in e.stages] for e in executors]
    if names[0] != names[1]:
        raise ValueError(f"lockstep needs the same operations in A and B: {names[0]} vs {names[1]}")
    for stages in zip(*(e.stages for e in executors), strict=True):
        for ops in zip(*stages, strict=True):
            _run_lockstep_operation(executors, ops, join_row_wise)
        if barriers:
            _pin_round(executors)
    return [e.stage_output for e in executors]


def _pair_executors(inputs_arr, operations_arr, contexts_arr, state_type) -> list[_StageExecutor]:
    """Micro-batch A's and B's executors, each under its named scope.

    Raises:
      ValueError: an argument that does not hold two micro-batches, or an empty stage.
    """
    _check_pair("inputs_arr", inputs_arr)
    _check_pair("operations_arr", operations_arr)
    _check_pair("contexts_arr", contexts_arr)
    return [
        _StageExecutor(scope, convert_operations_to_stages(ops), inputs, context, state_type)
        for scope, ops, inputs, context in zip(
            MICRO_BATCH_SCOPES, operations_arr, inputs_arr, contexts_arr, strict=True
        )
    ]


def _stagger(executors: Sequence[_StageExecutor], delta_stages: Sequence[int]) -> int:
    """B's delay ``d`` in stages, checked against both executors' stage counts.

    Raises:
      ValueError: ``delta_stages[0] != 0``, stage counts that differ, or ``d`` outside
        ``[0, stages]``.
    """
    if delta_stages[0] != 0:
        raise ValueError(f"delta_stages[0] must be 0, got {delta_stages[0]}")
    executor_a, executor_b = executors
    if executor_a.num_stages != executor_b.num_stages:
        raise ValueError(
            f"stage counts differ: A has {executor_a.num_stages}, B has {executor_b.num_stages}"
        )
    delta = delta_stages[1]
    if not 0 <= delta <= executor_a.num_stages:
        raise ValueError(f"delta_stages[1]={delta} outside [0, {executor_a.num_stages}]")
    return delta


def _run_lockstep_operation(
    executors: Sequence[_StageExecutor], ops: Sequence[ExecutionOperation], join_row_wise: bool
):
    """One operation of both micro-batches: its joint form once, else A's then B's."""
    joint_fn = ops[0].joint_fn
    if joint_fn is None and join_row_wise and ops[0].row_wise:
        joint_fn = functools.partial(row_joint.run_joint, ops[0].fn)
    if joint_fn is not None:
        with jax.named_scope(JOINT_SCOPE), jax.named_scope(ops[0].debug_name):
            outputs = joint_fn(
                tuple(e.state for e in executors), tuple(e.stage_output for e in executors)
            )
        for executor, output in zip(executors, outputs, strict=True):
            executor.stage_output = output
        return
    for executor, op in zip(executors, ops, strict=True):
        with _maybe_scope(executor.scope), jax.named_scope(op.debug_name):
            executor.stage_output = op.fn(executor.state, **(executor.stage_output or {}))


def _check_pair(name: str, value: Sequence) -> None:
    if len(value) != 2:
        raise ValueError(f"{name} must hold 2 micro-batches, got {len(value)}")


def _rounds(executor_a, executor_b, delta: int) -> Iterator[tuple]:
    for _ in range(delta):
        yield (executor_a,)
    for _ in range(executor_a.num_stages - delta):
        yield (executor_a, executor_b)
    for _ in range(delta):
        yield (executor_b,)


def _is_in_flight(value: Any) -> bool:
    return isinstance(value, InFlight)


def _pin_before_issue(executors: Sequence[_StageExecutor]) -> None:
    """The issue barrier: pins both micro-batches' live arrays, in-flight results included.

    Skipped once the other micro-batch has no collective left to issue: its remaining work
    then needs no order against this collective, and pinning it would only keep it out of
    the window (in decode, where B's last stages run alone, B's last exchanges would then have
    nothing beside them and XLA makes them synchronous).
    """
    if all(executor.issues_ahead() for executor in executors):
        _pin_round(executors, in_flight=True)


def _pin_round(executors: Sequence[_StageExecutor], *, in_flight: bool = False) -> None:
    """Puts one ``optimization_barrier`` over every executor's live arrays.

    Live arrays are the last stage output and the state entries set by operations; context
    entries are inputs of the whole program and need no pinning. ``InFlight`` values are left
    out unless ``in_flight``, which pins them too (their collectives then finish before the
    barrier).
    """
    live = [(executor.stage_output, executor.state.live_values()) for executor in executors]
    if in_flight:
        live = jax.tree.map(_open_in_flight, live, is_leaf=_is_in_flight)
    leaves, treedef = jax.tree.flatten(live, is_leaf=_is_in_flight)
    pinned_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    if pinned_at:
        pinned = lax.optimization_barrier([leaves[i] for i in pinned_at])
        for i, value in zip(pinned_at, pinned, strict=True):
            leaves[i] = value
    pinned_live = jax.tree.unflatten(treedef, leaves)
    if in_flight:
        pinned_live = jax.tree.map(_close_in_flight, pinned_live, is_leaf=_is_opened)
    for executor, (output, values) in zip(executors, pinned_live, strict=True):
        executor.stage_output = output
        executor.state.replace_live_values(values)


@dataclasses.dataclass(frozen=True)
class _Opened:
    """An ``InFlight`` value opened for pinning (a pytree node over the collective's output)."""

    value: Any


jax.tree_util.register_dataclass(_Opened, data_fields=["value"], meta_fields=[])


def _is_opened(value: Any) -> bool:
    return isinstance(value, _Opened)


def _open_in_flight(value: Any) -> Any:
    return _Opened(value.value) if isinstance(value, InFlight) else value


def _close_in_flight(value: Any) -> Any:
    return InFlight(value.value) if isinstance(value, _Opened) else value
