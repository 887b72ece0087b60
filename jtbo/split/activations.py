"""In-graph TBO split of activations at a traced token index, and the inverse merge.

Inside the jitted step the split token index ``t`` and the real token count ``n`` change every
step, so they are traced int32 scalars; the children's buffers need a *static* row count, the
child capacity. Child A is rows ``[0, t)`` and child B rows ``[t, n)`` of the parent, each
zero-padded to that capacity (SGLang ``_model_forward_filter_inputs``); the merge writes them
back at their parent offsets into a zero buffer (``_model_forward_tbo_merge_outputs``).

Child capacity bound, for a parent of ``n <= C`` real tokens (``jtbo.split.plan`` rules):

* a balanced (seq-boundary) split that is not two-chunk has ``left >= n * threshold`` and
  ``left <= n * (1 - threshold)`` (SGLang's float comparisons), so A holds at most
  ``floor(n * (1 - threshold))`` and B at most ``n - ceil(n * threshold)`` tokens; with
  ``threshold = 0`` that is all ``n`` (two-chunk is off, one long prompt goes to one side);
* a two-chunk split cuts at ``n // 2``: B holds ``ceil(n / 2)``;
* the degeneracy fallback happens (for sequences of >= 1 token) only when the first
  ``n // 2`` sequences have one token each, so the balanced cut at ``n // 2`` exists and
  the larger side is again at most ``ceil(n / 2)``;
* DECODE / TARGET_VERIFY put ``ceil(bs / 2) * token_num_per_seq`` tokens in B, with
  ``bs <= C // token_num_per_seq``.

Each term grows with ``n``, so the bound at ``n = C`` is the capacity, rounded up to
``attn_tp_size``. Zero-length sequences in an EXTEND batch can defeat the fallback argument, so
the runner checks every plan with ``plan_fits_capacity`` on the host and runs a plan that does
not fit without TBO: out-of-capacity rows would otherwise be dropped by the copy kernels.

The bound is the capacity of the most uneven split; a step's split is usually closer to even,
and each child computes every row of its capacity. ``child_capacities`` therefore lists a few
static capacities from the even split's ``ceil(C / 2)`` up to the bound, and the runner picks
the smallest that holds the step's split (one compile each).
"""

import math
from typing import Any

import jax
import jax.numpy as jnp

from jtbo import kernels
from jtbo.core import arith
from jtbo.split import plan


def child_capacity(
    token_capacity: int,
    *,
    threshold: float = plan.DEFAULT_THRESHOLD,
    attn_tp_size: int = 1,
    token_num_per_seq: int = 1,
    decode_like: bool = False,
) -> int:
    """Static row count that holds either TBO child of a parent of ``token_capacity`` rows.

    Args:
      token_capacity: static token rows of the parent (its bucket).
      threshold: SGLang's ``tbo_token_distribution_threshold``.
      attn_tp_size: the result is a multiple of it (children are scattered over attn_tp).
      token_num_per_seq: tokens per sequence of decode-like steps (``draft_token_num`` for
        TARGET_VERIFY); 1 covers DECODE and EXTEND.
      decode_like: the parent is a DECODE / TARGET_VERIFY step, whose split is always half
        the sequences: only the decode bound applies. The general bound holds the balanced
        EXTEND split too, which can leave ``floor(C * (1 - threshold))`` rows on one side:
        66 of 128 at the default threshold, and every child operation of a decode step would
        carry those padding rows (on one H200 the merged expert GEMM of a decode-128 TBO
        step ran a 72-row tile per expert instead of 64).

    Returns:
      The capacity (module docstring): max of the balanced, two-chunk and decode bounds, or
      the decode bound alone when ``decode_like``.

    Raises:
      ValueError: a negative capacity, ``attn_tp_size`` or ``token_num_per_seq`` < 1, or a
        threshold outside [0, 0.5].
    """
    plan.check_threshold(threshold)
    if token_capacity < 0:
        raise ValueError(f"token_capacity must be >= 0, got {token_capacity}")
    if attn_tp_size < 1 or token_num_per_seq < 1:
        raise ValueError(f"attn_tp_size={attn_tp_size} and token_num_per_seq="
                         f"{token_num_per_seq} must be >= 1")  # fmt: skip
    c = token_capacity
    balanced = max(math.floor(c * (1 - threshold)), c - math.ceil(c * threshold))
    half = arith.ceil_div(c, 2)
    decode = arith.ceil_div(c // token_num_per_seq, 2) * token_num_per_seq
    if decode_like:
        return arith.round_up(decode, attn_tp_size)
    return arith.round_up(max(balanced, half, decode), attn_tp_size)


DEFAULT_CHILD_BUCKETS = 2
"""Child capacities per parent bucket (``child_capacities``): the even split's and the bound."""


def check_child_buckets(count: int, name: str = "count") -> None:
    """Raises ValueError (naming the field ``name``) unless ``count >= 1`` child capacities."""
    if count < 1:
        raise ValueError(f"{name}={count} must be >= 1")


def child_capacities(
    token_capacity: int,
    *,
    count: int = DEFAULT_CHILD_BUCKETS,
    threshold: float = plan.DEFAULT_THRESHOLD,
    attn_tp_size: int = 1,
    token_num_per_seq: int = 1,
    decode_like: bool = False,
) -> tuple[int, ...]:
    """The static child capacities a TBO step of a ``token_capacity`` parent picks from.

    ``child_capacity`` holds every split the plan rules allow, but every row of a child's
    buffers is computed (its matmuls, norms, attention inputs), so a step whose split is even
    would carry ``bound - C / 2`` padding rows per child: 81 of 2129 at 4096 tokens and the
    default threshold, 4 % more rows than the plain step. The runner instead picks, per step,
    the smallest of these capacities that holds its split (in its planning): up to
    ``count`` values evenly spaced from the even split's ``ceil(C / 2)`` to the bound, each a
    separate compile of the TBO program.

    Args:
      token_capacity: static token rows of the parent (its bucket).
      count: how many capacities at most (>= 1); 1 gives the bound alone.
      threshold: SGLang's ``tbo_token_distribution_threshold``.
      attn_tp_size: every capacity is a multiple of it.
      token_num_per_seq: tokens per sequence of decode-like steps.
      decode_like: a DECODE / TARGET_VERIFY parent, whose split is always half the sequences:
        its bound is the only capacity.

    Returns:
      Strictly increasing capacities ending with ``child_capacity(...)`` of the same arguments.

    Raises:
      ValueError: ``count < 1``, or what ``child_capacity`` raises.
    """
    check_child_buckets(count)
    bound = child_capacity(
        token_capacity, threshold=threshold, attn_tp_size=attn_tp_size,
        token_num_per_seq=token_num_per_seq, decode_like=decode_like,
    )  # fmt: skip
    if decode_like or count == 1:
        return (bound,)
    even = min(arith.round_up(arith.ceil_div(token_capacity, 2), attn_tp_size), bound)
    steps = [even + arith.ceil_div((bound - even) * i, count - 1) for i in range(count)]
    return tuple(sorted({arith.round_up(value, attn_tp_size) for value in steps}))


def plan_fits_capacity(split_token_index: int, num_tokens: int, *, child_capacity: int) -> bool:
    """Whether both children of a host plan fit the static child capacity.

    Args:
      split_token_index: the planned token split.
      num_tokens: real tokens of the parent.
      child_capacity: from ``child_capacity``.

    Returns:
      True when ``split_token_index`` and ``num_tokens - split_token_index`` are both within
      the capacity; a plan that does not fit must run without TBO.

    Raises:
      ValueError: ``split_token_index`` outside ``[0, num_tokens]``.
    """
    if not 0 <= split_token_index <= num_tokens:
        raise ValueError(
            f"split_token_index={split_token_index} outside [0, num_tokens={num_tokens}]"
        )
    return max(split_token_index, num_tokens - split_token_index) <= child_capacity


def _rows_of(tree: Any, name: str) -> int:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise ValueError(f"{name} has no array leaves")
    rows = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(rows) != 1 or None in rows:
        raise ValueError(f"every leaf of {name} needs the same leading token axis, got {rows}")
    return rows.pop()


def _child_rows(tree_a: Any, tree_b: Any) -> tuple[int, int]:
    """Both children's row counts, after checking they share one structure and a leading axis."""
    if jax.tree.structure(tree_a) != jax.tree.structure(tree_b):
        raise ValueError(
            f"tree_a and tree_b differ in structure: {jax.tree.structure(tree_a)} vs "
            f"{jax.tree.structure(tree_b)}"
        )
    return _rows_of(tree_a, "tree_a"), _rows_of(tree_b, "tree_b")


def split_inputs(
    tree: Any,
    split_token_index: Any,
    num_tokens: Any,
    *,
    child_capacity: int,
    impl: str | None = None,
) -> tuple[Any, Any]:
    """Cuts every leaf's token rows into TBO children A = ``[0, t)`` and B = ``[t, n)``.

    Args:
      tree: pytree of arrays with a shared leading token axis (hidden states, residual,
        positions, ...).
      split_token_index: int32 scalar ``t`` (may be traced).
      num_tokens: int32 scalar ``n``, the parent's real tokens (may be traced).
      child_capacity: static rows of each child buffer (``child_capacity``).
      impl: ``jtbo.kernels`` implementation (None: the fastest available).

    Returns:
      ``(tree_a, tree_b)`` with leaves ``[child_capacity, ...]``, zero past each child's rows.

    Raises:
      ValueError: leaves without a shared leading axis, or bad scalars / capacity.
    """
    _rows_of(tree, "tree")
    length_b = num_tokens - split_token_index

    def cut(x, start, length):
        return kernels.slice_pad(x, start, length, capacity=child_capacity, impl=impl)

    tree_a = jax.tree.map(lambda x: cut(x, 0, split_token_index), tree)
    tree_b = jax.tree.map(lambda x: cut(x, split_token_index, length_b), tree)
    return tree_a, tree_b


def merge_outputs(
    tree_a: Any,
    tree_b: Any,
    split_token_index: Any,
    num_tokens: Any,
    *,
    out_len: int,
    impl: str | None = None,
) -> Any:
    """Inverse of ``split_inputs``: children's rows back at their parent offsets.

    Args:
      tree_a: child A's outputs, leaves ``[child_capacity, ...]``.
      tree_b: child B's outputs, same structure.
      split_token_index: int32 scalar ``t`` (may be traced).
      num_tokens: int32 scalar ``n`` (may be traced).
      out_len: static rows of the merged leaves (the parent's capacity).
      impl: ``jtbo.kernels`` implementation (None: the fastest available).

    Returns:
      Pytree like ``tree_a`` with leaves ``[out_len, ...]``: rows ``[0, t)`` from A, rows
      ``[t, n)`` from B, zero past ``n``.

    Raises:
      ValueError: trees of different structure or leaves without a shared leading axis.
    """
    _child_rows(tree_a, tree_b)
    starts = (0, split_token_index)
    lengths = (split_token_index, num_tokens - split_token_index)

    def merge(a, b):
        return kernels.merge_rows((a, b), starts, lengths, out_len=out_len, impl=impl)

    return jax.tree.map(merge, tree_a, tree_b)


def take_merged_rows(tree_a: Any, tree_b: Any, split_token_index: Any, rows: jax.Array) -> Any:
    """Rows of the merged parent, read from the children without merging them.

    ``take_merged_rows(a, b, t, rows)`` equals ``merge_outputs(a, b, t, n)[rows]`` for rows
    below ``n``: a parent row ``r < t`` is A's row ``r``, any other B's row ``r - t``. A step
    that needs only a few rows (each sequence's last one, for the LM head) reads them from
    the two children instead of writing the whole merged buffer first.

    Args:
      tree_a: child A's outputs, leaves ``[child_capacity, ...]``.
      tree_b: child B's outputs, same structure.
      split_token_index: int32 scalar ``t`` (may be traced).
      rows: ``[width]`` int32 parent rows (may be traced).

    Returns:
      Pytree like ``tree_a`` with leaves ``[width, ...]``.

    Raises:
      ValueError: trees of different structure or leaves without a shared leading axis.
    """
    capacity_a, capacity_b = _child_rows(tree_a, tree_b)
    in_a = rows < split_token_index
    row_a = jnp.clip(rows, 0, capacity_a - 1)
    row_b = jnp.clip(rows - split_token_index, 0, capacity_b - 1)

    def take(a, b):
        pick = in_a.reshape(in_a.shape + (1,) * (a.ndim - 1))
        return jnp.where(pick, a[row_a], b[row_b])

    return jax.tree.map(take, tree_a, tree_b)
