"""Operations, stages and the staggered two-micro-batch executor (SGLang ``operations.py``).

A layer is written as a flat list of *operations*: callables ``op(state, **inputs) -> outputs``
where ``inputs`` is the mapping the previous operation returned and ``state`` is a
per-micro-batch scratch space. ``YieldOperation`` markers cut the list into *stages*.
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

Round barriers (optional). ``lax.optimization_barrier`` over both micro-batches' live arrays
after every round pins the rounds: nothing of round ``k + 1`` can be hoisted above the
barrier. A barrier must not include the result of a collective that is still in flight
across the yield (a ``*_a`` operation issues it, the matching ``*_b`` consumes it): that
would force the collective to finish inside its round and undo the overlap (measured: half
the coverage). An operation marks such a result by wrapping it in ``InFlight``; the barrier
leaves every ``InFlight`` value out and the consumer unwraps it with ``.value``.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax import lax

MICRO_BATCH_SCOPES = ("tbo_a", "tbo_b")  # named scopes of micro-batch A and B


@dataclasses.dataclass(frozen=True)
class YieldOperation:
    """Marks the end of a stage: the other micro-batch may run its next stage here."""


@dataclasses.dataclass(frozen=True)
class ExecutionOperation:
    """A named operation: ``fn(state, **inputs) -> outputs`` (outputs a mapping or None)."""

    debug_name: str  # shown as a named scope in the compiled program's op_name
    fn: Callable[..., Mapping[str, Any] | None]


Operation = YieldOperation | ExecutionOperation | Callable[..., Mapping[str, Any] | None]
Stage = list[ExecutionOperation]


@dataclasses.dataclass(frozen=True)
class InFlight:
    """The result of a collective still in flight across a yield; round barriers skip it.

    Not a pytree: it must be unwrapped (``.value``) before jax operations use it.
    """

    value: Any  # the collective's output, any pytree of arrays


class OperationState:
    """Per-micro-batch scratch space that refuses to overwrite a key.

    Entries set by operations are cleared by ``clear(expect_keys)`` at the end of a layer,
    which checks that exactly the expected keys are left (something left over means an
    operation holds memory longer than it should). Context entries (attention metadata,
    the micro-batch's EP dispatcher, DP context, ...) are given at construction, are
    read-only, and survive ``clear``.
    """

    def __init__(self, context: Mapping[str, Any] | None = None):
        """Creates an empty state over the read-only ``context`` entries."""
        object.__setattr__(self, "_context", dict(context or {}))
        object.__setattr__(self, "_data", {})

    def __setattr__(self, key: str, value: Any) -> None:
        if key in self._context:
            raise KeyError(f"state key `{key}` is a read-only context entry")
        if key in self._data:
            raise KeyError(f"state key `{key}` already exists; pop it before setting it again")
        self._data[key] = value

    def __getattr__(self, key: str) -> Any:
        data, context = self.__dict__["_data"], self.__dict__["_context"]
        if key in data:
            return data[key]
        if key in context:
            return context[key]
        raise AttributeError(f"state has no key `{key}` (keys: {sorted(data) + sorted(context)})")

    def __delattr__(self, key: str) -> None:
        self.pop(key)

    def __contains__(self, key: str) -> bool:
        return key in self._data or key in self._context

    def get(self, key: str, default: Any = None) -> Any:
        """Returns the entry or context entry ``key``, or ``default``."""
        return self._data.get(key, self._context.get(key, default))

    def pop(self, key: str) -> Any:
        """Removes and returns the entry ``key`` (context entries cannot be popped)."""
        if key not in self._data:
            raise KeyError(f"state has no (non-context) key `{key}`")
        return self._data.pop(key)

    def update(self, values: Mapping[str, Any]) -> None:
        """Sets every entry of ``values`` (each must be new)."""
        for key, value in values.items():
            setattr(self, key, value)

    def keys(self) -> list[str]:
        """The keys set by operations (not the context)."""
        return list(self._data)

    def clear(self, expect_keys: Sequence[str]) -> None:
        """Drops every entry set by operations after checking they are exactly ``expect_keys``.

        Raises:
          KeyError: the entries differ from ``expect_keys``.
        """
        if set(self._data) != set(expect_keys):
            raise KeyError(
                f"unexpected state keys when clearing: have {sorted(self._data)}, "
                f"expected {sorted(expect_keys)}; an operation left something behind or "
                "released it too early"
            )
        self._data.clear()

    def live_values(self) -> dict[str, Any]:
        """The entries set by operations (for round barriers)."""
        return self._data

    def replace_live_values(self, values: Mapping[str, Any]) -> None:
        """Swaps the entries for ``values`` with the same keys (for round barriers)."""
        if set(values) != set(self._data):
            raise KeyError(f"keys changed: {sorted(values)} vs {sorted(self._data)}")
        self._data.update(values)


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
    if not callable(op):
        raise ValueError(f"operation {op!r} is neither a YieldOperation nor callable")
    name = getattr(op, "__name__", type(op).__name__)
    return ExecutionOperation(debug_name=name.removeprefix("op_"), fn=op)


class _StageExecutor:
    """Runs one micro-batch's stages one at a time under its named scope."""

    def __init__(self, scope: str | None, stages: list[Stage], inputs, context):
        self.scope = scope
        self.stages = stages
        self.index = 0
        self.state = OperationState(context)
        self.stage_output: Mapping[str, Any] | None = inputs

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def done(self) -> bool:
        return self.index >= self.num_stages

    def next(self) -> None:
        if self.done:
            raise RuntimeError(f"executor {self.scope} has no stage left")
        with _maybe_scope(self.scope):
            for op in self.stages[self.index]:
                with jax.named_scope(op.debug_name):
                    self.stage_output = op.fn(self.state, **(self.stage_output or {}))
        self.index += 1


def _maybe_scope(scope: str | None):
    return jax.named_scope(scope) if scope else contextlib.nullcontext()


def execute_operations(
    inputs: Mapping[str, Any],
    operations: Sequence[Operation],
    *,
    context: Mapping[str, Any] | None = None,
    scope: str | None = None,
) -> Mapping[str, Any] | None:
    """Runs one micro-batch (or the whole batch) through every stage of ``operations``.

    Args:
      inputs: keyword inputs of the first operation.
      operations: the operation list (yields are ignored apart from cutting stages).
      context: read-only state entries visible to every operation.
      scope: an optional named scope around every stage.

    Returns:
      The last operation's output.
    """
    executor = _StageExecutor(scope, convert_operations_to_stages(operations), inputs, context)
    while not executor.done:
        executor.next()
    return executor.stage_output


def execute_overlapped_operations(
    inputs_arr: Sequence[Mapping[str, Any]],
    operations_arr: Sequence[Sequence[Operation]],
    delta_stages: Sequence[int],
    *,
    contexts_arr: Sequence[Mapping[str, Any] | None] = (None, None),
    barriers: bool = False,
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

    Returns:
      [output of A, output of B].

    Raises:
      ValueError: two micro-batches are not given, ``delta_stages[0] != 0``, ``d`` is
        negative or exceeds the stage count, or the stage counts differ.
    """
    _check_pair("inputs_arr", inputs_arr)
    _check_pair("operations_arr", operations_arr)
    _check_pair("contexts_arr", contexts_arr)
    _check_pair("delta_stages", delta_stages)
    if delta_stages[0] != 0:
        raise ValueError(f"delta_stages[0] must be 0, got {delta_stages[0]}")
    delta = delta_stages[1]
    executors = [
        _StageExecutor(scope, convert_operations_to_stages(ops), inputs, context)
        for scope, ops, inputs, context in zip(
            MICRO_BATCH_SCOPES, operations_arr, inputs_arr, contexts_arr, strict=True
        )
    ]
    executor_a, executor_b = executors
    if executor_a.num_stages != executor_b.num_stages:
        raise ValueError(
            f"stage counts differ: A has {executor_a.num_stages}, B has {executor_b.num_stages}"
        )
    if not 0 <= delta <= executor_a.num_stages:
        raise ValueError(f"delta_stages[1]={delta} outside [0, {executor_a.num_stages}]")
    for round_executors in _rounds(executor_a, executor_b, delta):
        for executor in round_executors:
            executor.next()
        if barriers:
            _pin_round(executors)
    return [executor_a.stage_output, executor_b.stage_output]


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


def _pin_round(executors: Sequence[_StageExecutor]) -> None:
    """Puts one ``optimization_barrier`` over every executor's live arrays but ``InFlight`` ones.

    Live arrays are the last stage output and the state entries set by operations; context
    entries are inputs of the whole program and need no pinning.
    """
    live = [(executor.stage_output, executor.state.live_values()) for executor in executors]
    leaves, treedef = jax.tree.flatten(live, is_leaf=_is_in_flight)
    pinned_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    if not pinned_at:
        return
    pinned = lax.optimization_barrier([leaves[i] for i in pinned_at])
    for i, value in zip(pinned_at, pinned, strict=True):
        leaves[i] = value
    for executor, (output, values) in zip(
        executors, jax.tree.unflatten(treedef, leaves), strict=True
    ):
        executor.stage_output = output
        executor.state.replace_live_values(values)
