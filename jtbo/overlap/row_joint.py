"""Row-wise operations, run once over both micro-batches' rows in lockstep.

An operation is *row-wise* when every array it reads or writes (its inputs, the state entries
it pops, reads and sets, its outputs) has the micro-batch's rows as leading axis and each
output row depends on the same input row only: norms, residual adds, projections, the
router's gate, the shared experts, the LM head. Run on A's rows followed by B's it gives, row
by row, what it gives on each micro-batch.

The lockstep executor (``operations.execute_lockstep_operations``, one-device meshes) runs
such an operation once for both micro-batches when they are small (``join_row_wise``), where
a second launch of each small kernel costs more than concatenating the rows (docs/benchmarks/,
"Row-wise operations once for both micro-batches"). ``run_joint`` hands the operation a
``JointRowState``, which concatenates A's and B's entries on every read or pop and splits
every entry set back into the two states; inputs are concatenated and outputs split the same
way. Between two joint operations the split and the next concatenation meet, and XLA folds
``concatenate(slice(x), slice(x))`` back into ``x``, so a chain of them passes the joint rows
on.

A row-wise operation must not read context entries (attention metadata, dispatcher, token
counts: per micro-batch, not per row); ``JointRowState`` refuses them.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RowWiseOperation:
    """A layer operation marked row-wise (module docstring): ``fn(state, **inputs)``.

    ``strategy.layer_operations`` keeps the mark on the ``ExecutionOperation``.
    """

    fn: Callable[..., Mapping[str, Any] | None]  # one micro-batch: fn(state, **inputs)


def concat_rows(trees: Sequence[Any]) -> tuple[Any, int]:
    """A's and B's pytrees concatenated along their leading (row) axis.

    Args:
      trees: (A's, B's) pytrees of the same structure, every leaf an array whose leading axis
        is the micro-batch's rows (the same count for every leaf).

    Returns:
      ``(joint tree, rows of one micro-batch)``.

    Raises:
      ValueError: structures differ, a leaf is no array of rank >= 1, or leading axes differ.
    """
    tree_a, tree_b = trees
    leaves = jax.tree.leaves(tree_a) + jax.tree.leaves(tree_b)
    rows = {leaf.shape[0] if getattr(leaf, "ndim", 0) else None for leaf in leaves}
    if len(rows) != 1 or None in rows:
        raise ValueError(f"row-wise values need one leading row count, got {rows}")
    if jax.tree.structure(tree_a) != jax.tree.structure(tree_b):
        raise ValueError("A's and B's values differ in structure")
    joint = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), tree_a, tree_b)
    return joint, rows.pop()


def split_rows(tree: Any, rows: int) -> tuple[Any, Any]:
    """The inverse of ``concat_rows``: A's first ``rows`` rows of every leaf, and B's rest.

    Raises:
      ValueError: a leaf whose leading axis is not ``2 * rows``.
    """
    for leaf in jax.tree.leaves(tree):
        if getattr(leaf, "ndim", 0) < 1 or leaf.shape[0] != 2 * rows:
            raise ValueError(f"a row-wise result needs {2 * rows} rows, got {leaf!r:.80}")
    return jax.tree.map(lambda x: x[:rows], tree), jax.tree.map(lambda x: x[rows:], tree)


class JointRowState:
    """Both micro-batches' ``OperationState`` seen as one over their concatenated rows."""

    def __init__(self, states: Sequence[Any], rows: int | None):
        """Args: states: (A's, B's) states; rows: one micro-batch's rows, or None until the
        first concatenation tells them."""
        object.__setattr__(self, "_states", tuple(states))
        object.__setattr__(self, "rows", rows)

    def _joint(self, values: Sequence[Any]) -> Any:
        joint, rows = concat_rows(values)
        if self.rows not in (None, rows):
            raise ValueError(f"row-wise values of {rows} rows beside {self.rows}")
        object.__setattr__(self, "rows", rows)
        return joint

    def _check_not_context(self, key: str) -> None:
        if any(key in s and key not in s.live_values() for s in self._states):
            raise KeyError(f"a row-wise operation read the context entry `{key}`")

    def __getattr__(self, key: str) -> Any:
        self._check_not_context(key)
        return self._joint([getattr(s, key) for s in self._states])

    def pop(self, key: str) -> Any:
        """Pops ``key`` from both states; returns the concatenation."""
        self._check_not_context(key)
        return self._joint([s.pop(key) for s in self._states])

    def __setattr__(self, key: str, value: Any) -> None:
        if self.rows is None:
            raise ValueError(f"`{key}` set before any row-wise value was read")
        for state, part in zip(self._states, split_rows(value, self.rows), strict=True):
            setattr(state, key, part)

    def update(self, values: Mapping[str, Any]) -> None:
        """Sets every entry of ``values`` in both states (each split at A's rows)."""
        for key, value in values.items():
            setattr(self, key, value)


def run_joint(
    fn: Callable[..., Mapping[str, Any] | None],
    states: Sequence[Any],
    inputs: Sequence[Mapping[str, Any] | None],
) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """Runs the row-wise ``fn`` once over both micro-batches (module docstring).

    Args:
      fn: ``fn(state, **inputs) -> outputs`` of one micro-batch.
      states: (A's, B's) ``OperationState``.
      inputs: (A's, B's) inputs (None: none).

    Returns:
      (A's outputs, B's outputs), each None where ``fn`` returns None.

    Raises:
      ValueError: A's and B's inputs differ in keys, or values are not row-wise.
      KeyError: ``fn`` reads a context entry.
    """
    inputs_a, inputs_b = (dict(i or {}) for i in inputs)
    if set(inputs_a) != set(inputs_b):
        raise ValueError(f"A's inputs {sorted(inputs_a)} differ from B's {sorted(inputs_b)}")
    joint_inputs, rows = concat_rows((inputs_a, inputs_b)) if inputs_a else ({}, None)
    state = JointRowState(states, rows)
    outputs = fn(state, **joint_inputs)
    if outputs is None:
        return None, None
    return split_rows(dict(outputs), state.rows)
