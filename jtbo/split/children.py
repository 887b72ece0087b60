"""Pure split of a ``ForwardBatch`` into its two TBO children (SGLang ``TboForwardBatchPreparer``).

Given ``batch.tbo_split_seq_index = s`` and the planned token index ``t``:

* child A takes token rows ``[0, t)`` and sequences ``[0, s)``, or ``[0, s]`` for a two-chunk
  split (its last sequence is the first part of the cut prompt);
* child B takes token rows ``[t, num_tokens)`` and sequences ``[s, batch_size)``.

Token fields are sliced by the token range, per-sequence fields by the sequence range, and the
EAGLE verify input by both (``spec.split_spec_info``). For a two-chunk split the cut sequence
``s`` gets derived lengths: A's copy has ``extend_seq_lens = t - sum(lens[:s])`` (``left``) and
a ``seq_lens`` shortened to match; B's copy has ``extend_seq_lens = lens[s] - left`` and
``extend_prefix_lens`` grown by ``left`` (B's part of the prompt attends to A's part as cached
prefix). Each child also gets ``tbo_parent_token_range``, ``tbo_padded_len`` (its token count
rounded up to ``attn_tp_size``), ``num_token_non_padded`` and, when the parent has one, its own
``global_dp_buffer_len``.

Deliberate differences from SGLang: a child's ``extend_start_loc`` is always relative to its
own tokens (SGLang rebases only in the two-chunk case); an empty sequence range gets an empty
custom-mask slice; and MIXED batches get the two-chunk derived fields too (SGLang plans MIXED
two-chunk splits but derives the fields only for EXTEND, which leaves child A inconsistent).
The parent is never changed. A set field that this module does not know how to split is a
``ValueError`` naming it, never silently dropped.
"""

import dataclasses
from typing import Any

import numpy as np

from jtbo.core import arith
from jtbo.split import batch as batch_lib
from jtbo.split import forward_mode as forward_mode_lib
from jtbo.split import plan, spec

ForwardMode = forward_mode_lib.ForwardMode
_TWO_CHUNK_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)
_EXTEND_SEQ_FIELDS = ("extend_seq_lens", "extend_prefix_lens", "extend_start_loc")
_COPIED_FIELDS = ("forward_mode", "dp_padding_mode", "global_forward_mode")


@dataclasses.dataclass(frozen=True)
class _ChildRange:
    start_token: int
    end_token: int
    start_seq: int
    end_seq: int
    num_token_non_padded: int


def padded_len(num_tokens: int, attn_tp_size: int) -> int:
    """``num_tokens`` rounded up to a multiple of ``attn_tp_size`` (SGLang ``tbo_padded_len``).

    Args:
      num_tokens: non-negative token count.
      attn_tp_size: attention tensor-parallel size, >= 1.

    Returns:
      The smallest multiple of ``attn_tp_size`` that is >= ``num_tokens``.
    """
    return arith.round_up(num_tokens, attn_tp_size)


def _seq_field(batch: batch_lib.ForwardBatch, name: str, rows: _ChildRange) -> Any:
    value = getattr(batch, name)
    if value is None or (batch.forward_mode.is_target_verify() and name in _EXTEND_SEQ_FIELDS):
        return None
    return value[rows.start_seq : rows.end_seq]


def _start_loc(batch: batch_lib.ForwardBatch, lens: Any, rows: _ChildRange) -> Any:
    """A child's extend_start_loc, relative to the child's own first token row."""
    if batch.extend_start_loc is None or batch.forward_mode.is_target_verify():
        return None
    if lens is not None:
        return batch_lib.exclusive_cumsum(lens)
    parent = np.asarray(batch.extend_start_loc[rows.start_seq : rows.end_seq])
    return np.maximum(parent - rows.start_token, 0).astype(np.int32)


def filter_batch(
    batch: batch_lib.ForwardBatch, rows: _ChildRange, *, attn_tp_size: int
) -> dict[str, Any]:
    """Field values of the child that owns ``rows`` (before two-chunk adjustments)."""
    out: dict[str, Any] = {name: getattr(batch, name) for name in _COPIED_FIELDS}
    for name in batch_lib.TOKEN_FIELDS:
        value = getattr(batch, name)
        out[name] = None if value is None else value[rows.start_token : rows.end_token]
    for name in batch_lib.SEQ_FIELDS:
        out[name] = _seq_field(batch, name, rows)
    out["extend_start_loc"] = _start_loc(batch, out["extend_seq_lens"], rows)
    out["spec_info"] = spec.split_spec_info(
        batch.spec_info,
        start_seq_index=rows.start_seq,
        end_seq_index=rows.end_seq,
        start_token_index=rows.start_token,
        end_token_index=rows.end_token,
    )
    num_tokens = rows.end_token - rows.start_token
    ragged = batch.forward_mode in batch_lib.RAGGED_EXTEND_MODES
    buffer_len = None if batch.global_dp_buffer_len is None else num_tokens
    out.update(
        batch_size=rows.end_seq - rows.start_seq,
        extend_num_tokens=num_tokens if ragged else None,
        tbo_split_seq_index=None,
        global_num_tokens=None,
        global_dp_buffer_len=buffer_len,
        tbo_parent_token_range=(rows.start_token, rows.end_token),
        tbo_padded_len=padded_len(num_tokens, attn_tp_size),
        num_token_non_padded=rows.num_token_non_padded,
    )
    return out


def _check_all_fields_known(batch: batch_lib.ForwardBatch, out: dict[str, Any]) -> None:
    for field in dataclasses.fields(batch):
        if field.name not in out and getattr(batch, field.name) is not None:
            raise ValueError(
                f"split_batch does not know how to split field {field.name!r}, which is set "
                f"on the batch ({type(batch).__name__})"
            )


def _replace_row(value: Any, index: int, new: int) -> Any:
    if value is None:
        return None
    value = np.array(value, copy=True)
    value[index] = new
    return value


def _two_chunk_fields(
    batch: batch_lib.ForwardBatch, a: dict[str, Any], b: dict[str, Any], split_token: int
) -> None:
    """Derives the cut sequence's lengths in both children (see the module docstring)."""
    lens = batch.extend_seq_lens
    s = int(batch.tbo_split_seq_index)
    left = split_token - int(np.sum(lens[:s]))
    if s >= batch.batch_size or not 0 <= left < int(lens[s]):
        raise ValueError(
            f"tbo_split_seq_index={s} does not hold token row {split_token} of a two-chunk "
            f"split (extend_seq_lens={np.asarray(lens).tolist()})"
        )
    right = int(lens[s]) - left
    a["extend_seq_lens"] = _replace_row(a["extend_seq_lens"], -1, left)
    if batch.seq_lens is not None:
        a["seq_lens"] = _replace_row(a["seq_lens"], -1, int(batch.seq_lens[s]) - right)
    b["extend_seq_lens"] = _replace_row(b["extend_seq_lens"], 0, right)
    if batch.extend_prefix_lens is not None:
        prefix = int(batch.extend_prefix_lens[s]) + left
        b["extend_prefix_lens"] = _replace_row(b["extend_prefix_lens"], 0, prefix)
    for child in (a, b):
        if child["extend_start_loc"] is not None:
            child["extend_start_loc"] = batch_lib.exclusive_cumsum(child["extend_seq_lens"])


def _split_token_index(batch: batch_lib.ForwardBatch, threshold: float) -> tuple[int, bool]:
    """``(split_token_index, two_chunk)`` for the batch's own ``tbo_split_seq_index``."""
    s, mode = int(batch.tbo_split_seq_index), batch.forward_mode
    if mode not in _TWO_CHUNK_MODES:
        per_seq = plan.get_token_num_per_seq(mode, batch.spec_info)
        return plan.compute_split_token_index(s, mode, None, per_seq, threshold=threshold), False
    lens = batch.extend_seq_lens
    if lens is None:
        raise ValueError(f"{mode.name} batches need extend_seq_lens to be split")
    _, half, two_chunk = plan.plan_extend_split(lens, threshold=threshold)
    return (half if two_chunk else int(lens[:s].sum())), two_chunk


def plan_tbo_split(
    batch: batch_lib.ForwardBatch, *, threshold: float = plan.DEFAULT_THRESHOLD
) -> batch_lib.ForwardBatch:
    """The batch with ``tbo_split_seq_index`` planned from its own lengths.

    Args:
      batch: a host batch.
      threshold: SGLang's ``tbo_token_distribution_threshold``.

    Returns:
      A copy with ``tbo_split_seq_index`` = ``compute_split_seq_index(...)`` (None for a mode
      TBO does not split, i.e. TBO off for this batch).

    Raises:
      ValueError: as ``compute_split_seq_index``.
    """
    mode = batch.forward_mode
    if mode in _TWO_CHUNK_MODES:
        if batch.extend_seq_lens is None:
            raise ValueError(f"{mode.name} batches need extend_seq_lens to be planned")
        s = plan.plan_extend_split(batch.extend_seq_lens, threshold=threshold)[0]
    else:
        per_seq = plan.get_token_num_per_seq(mode, batch.spec_info)
        s = plan.compute_split_seq_index(mode, batch.num_tokens, None, per_seq, threshold=threshold)
    return batch_lib.replace_derived(batch, tbo_split_seq_index=s)


def split_batch(
    batch: batch_lib.ForwardBatch,
    *,
    attn_tp_size: int = 1,
    threshold: float = plan.DEFAULT_THRESHOLD,
) -> tuple[batch_lib.ForwardBatch, batch_lib.ForwardBatch]:
    """Splits a host batch at ``batch.tbo_split_seq_index`` into TBO children A and B.

    Args:
      batch: a host ``ForwardBatch`` (numpy leaves, validated on construction) with
        ``tbo_split_seq_index`` set (``plan_tbo_split`` or ``compute_split_seq_index``).
      attn_tp_size: attention tensor-parallel size; children's ``tbo_padded_len`` is a multiple.
      threshold: SGLang's ``tbo_token_distribution_threshold`` (must match the planning call).

    Returns:
      ``(child_a, child_b)``, new batches; the parent is unchanged.

    Raises:
      ValueError: no split index, a mode TBO does not split, a field that cannot be split, an
        inconsistent batch or split index (names the field and the numbers).
    """
    if attn_tp_size < 1:
        raise ValueError(f"attn_tp_size must be >= 1, got {attn_tp_size}")
    if batch.tbo_split_seq_index is None:
        raise ValueError("split_batch needs batch.tbo_split_seq_index, got None")
    s = int(batch.tbo_split_seq_index)
    if not 0 <= s <= batch.batch_size:
        raise ValueError(f"tbo_split_seq_index={s} outside [0, batch_size={batch.batch_size}]")
    t, two_chunk = _split_token_index(batch, threshold)
    n, bs = batch.num_tokens, batch.batch_size
    real_a, real_b = plan.compute_tbo_children_num_token_non_padded(t, batch.num_valid_tokens)
    rows_a = _ChildRange(0, t, 0, s + 1 if two_chunk else s, real_a)
    rows_b = _ChildRange(t, n, s, bs, real_b)
    a = filter_batch(batch, rows_a, attn_tp_size=attn_tp_size)
    b = filter_batch(batch, rows_b, attn_tp_size=attn_tp_size)
    _check_all_fields_known(batch, a)
    if two_chunk:
        _two_chunk_fields(batch, a, b, t)
    # The parent was validated when it was built and the children are derived from it by the
    # code above (whose output the tests validate), so they skip the constructor's checks.
    return batch_lib.replace_derived(batch, **a), batch_lib.replace_derived(batch, **b)
