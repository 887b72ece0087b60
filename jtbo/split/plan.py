"""Host planning of the two-batch-overlap split (SGLang ``two_batch_overlap.py`` semantics).

Pure Python integers; no device work. The split of one DP rank's batch into micro-batches
A and B is described by a *sequence* index ``s`` and a *token* index ``t``:

* EXTEND / MIXED: the **balanced split** scans cut points ``i = 1 .. n-1`` and keeps the last
  one whose ``|left - right|`` token difference does not exceed the best seen so far (ties go
  right), stopping at the first cut that is worse. Then ``t = sum(extend_lens[:s])``.
* **Two-chunk split**: if that cut leaves the left side under ``threshold`` of the tokens (or
  over ``1 - threshold``), one long prompt is cut in two at ``t = total // 2``. ``s`` is the
  sequence holding token row ``total // 2``; A gets sequences ``[0, s]`` (its last one
  truncated) and B gets ``[s, n)`` (its first one starting mid-prompt). SGLang's degeneracy
  fallback keeps the balanced split when A would get more sequences than tokens
  (``s + 1 > total // 2``, e.g. one sequence of one token), since an attention planner needs at
  least one query token per sequence. ``threshold = 0`` disables two-chunk.
* DECODE / TARGET_VERIFY: half of the sequences, ``s = (num_tokens // per_seq) // 2`` and
  ``t = s * per_seq``.
* IDLE / PREBUILT: no tokens; ``s = t = 0``.
* DRAFT_EXTEND: TBO does not split it (``compute_split_seq_index`` returns None).
"""

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode
DEFAULT_THRESHOLD = 0.48
_BALANCED_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)


def check_threshold(threshold: float) -> None:
    """Raises ValueError unless ``0 <= threshold <= 0.5`` (``tbo_token_distribution_threshold``)."""
    if not 0.0 <= threshold <= 0.5:
        raise ValueError(f"threshold (tbo_token_distribution_threshold) must be in [0, 0.5], got "
                         f"{threshold}")  # fmt: skip


def _check_lengths(name: str, lengths: Sequence[int] | None) -> list[int]:
    if lengths is None:
        raise ValueError(f"{name} is required for EXTEND/MIXED planning, got None")
    values = lengths.tolist() if isinstance(lengths, np.ndarray) else list(lengths)
    if values and min(values) < 0:
        raise ValueError(f"{name} has a negative length: {min(values)}")
    return values


def _check_per_seq(forward_mode: ForwardMode, token_num_per_seq: int | None) -> int:
    if token_num_per_seq is None or token_num_per_seq < 1:
        raise ValueError(
            f"token_num_per_seq must be >= 1 for {forward_mode.name}, got {token_num_per_seq}"
        )
    return int(token_num_per_seq)


def get_token_num_per_seq(forward_mode: ForwardMode, spec_info: Any = None) -> int | None:
    """Tokens per sequence: ``draft_token_num`` (TARGET_VERIFY), 1 (DECODE), 0 (IDLE), else None.

    Args:
      forward_mode: the step's mode.
      spec_info: object with ``draft_token_num`` (needed for TARGET_VERIFY).

    Returns:
      The count, or None for ragged modes (EXTEND, MIXED, ...), which use ``extend_lens``.

    Raises:
      ValueError: TARGET_VERIFY without spec_info.
    """
    if forward_mode.is_target_verify():
        if spec_info is None:
            raise ValueError("TARGET_VERIFY needs spec_info.draft_token_num, got spec_info=None")
        return int(spec_info.draft_token_num)
    if forward_mode.is_decode():
        return 1
    if forward_mode.is_idle():
        return 0
    return None


def _balanced_from_cumsum(cumsum: list[int]) -> int:
    # SGLang's ``_split_array_by_balanced_sum`` over the prefix sums.
    # Left sums L_i = cumsum[i - 1] of the cuts i = 1 .. n-1 never decrease, so |2 L_i - total|
    # falls then rises: its minimum sits next to where 2 L_i first reaches the total, and
    # SGLang's scan (ties go right, stop at the first worse cut) ends on the last cut that
    # attains it, i.e. the last one with 2 L_i - total <= that minimum.
    if len(cumsum) < 2:
        return 0
    lefts, total = cumsum[:-1], cumsum[-1]
    crossing = bisect.bisect_left(lefts, (total + 1) // 2)
    nearest = lefts[max(crossing - 1, 0) : crossing + 1]
    best = min(abs(2 * left - total) for left in nearest)
    return bisect.bisect_right(lefts, (total + best) // 2)


def _crossing_from_cumsum(cumsum: list[int]) -> int:
    # SGLang's ``_split_array_by_cum_less_than_half``: the first sequence whose prefix sum
    # passes ``total // 2`` (0 if none does).
    index = bisect.bisect_right(cumsum, cumsum[-1] // 2) if cumsum else 0
    return index if index < len(cumsum) else 0


def _extend_split(lengths: list[int], threshold: float) -> tuple[int, int, bool]:
    """``(split_seq_index, split_token_index, two_chunk)`` of checked EXTEND/MIXED lengths."""
    cumsum = list(itertools.accumulate(lengths))
    total = cumsum[-1] if cumsum else 0
    balanced = _balanced_from_cumsum(cumsum)
    left = cumsum[balanced - 1] if balanced else 0
    if left < total * threshold or left > total * (1 - threshold):
        crossing = _crossing_from_cumsum(cumsum)
        # Degeneracy fallback: A would hold seqs [0, crossing] but only total // 2 tokens.
        if crossing + 1 <= total // 2:
            return crossing, total // 2, True
    return balanced, left, False


def plan_extend_split(
    extend_lens: Sequence[int], *, threshold: float = DEFAULT_THRESHOLD
) -> tuple[int, int, bool]:
    """The whole EXTEND/MIXED plan in one pass over the lengths.

    Args:
      extend_lens: per-sequence new-token counts.
      threshold: SGLang's ``tbo_token_distribution_threshold``.

    Returns:
      ``(split_seq_index, split_token_index, two_chunk)``: the first two equal what
      ``compute_split_seq_index`` and ``compute_split_token_index`` return for these lengths;
      ``two_chunk`` says whether the split cuts one sequence in two (SGLang's
      ``_is_two_chunk_split_enabled``).

    Raises:
      ValueError: threshold outside [0, 0.5], missing or negative lengths.
    """
    check_threshold(threshold)
    return _extend_split(_check_lengths("extend_lens", extend_lens), threshold)


def compute_split_seq_index(
    forward_mode: ForwardMode,
    num_tokens: int,
    extend_lens: Sequence[int] | None,
    token_num_per_seq: int | None,
    *,
    threshold: float = DEFAULT_THRESHOLD,
) -> int | None:
    """The sequence index at which TBO splits a batch (``tbo_split_seq_index``).

    Args:
      forward_mode: the step's mode.
      num_tokens: token rows of the batch (DECODE / TARGET_VERIFY / IDLE / PREBUILT).
      extend_lens: per-sequence new-token counts (EXTEND / MIXED).
      token_num_per_seq: tokens per sequence (DECODE: 1, TARGET_VERIFY: draft_token_num).
      threshold: SGLang's ``tbo_token_distribution_threshold``.

    Returns:
      The index, or None for DRAFT_EXTEND (TBO does not split it).

    Raises:
      ValueError: a missing or inconsistent argument for the mode (names it and the numbers).
    """
    check_threshold(threshold)
    if forward_mode in _BALANCED_MODES:
        return _extend_split(_check_lengths("extend_lens", extend_lens), threshold)[0]
    if forward_mode.is_decode() or forward_mode.is_target_verify():
        per_seq = _check_per_seq(forward_mode, token_num_per_seq)
        if num_tokens < 0 or num_tokens % per_seq:
            raise ValueError(f"num_tokens={num_tokens} is not a non-negative multiple of "
                             f"token_num_per_seq={per_seq}")  # fmt: skip
        return (num_tokens // per_seq) // 2
    if forward_mode.is_idle() or forward_mode.is_prebuilt():
        if num_tokens != 0:
            raise ValueError(f"{forward_mode.name} has no tokens, got num_tokens={num_tokens}")
        return 0
    return None


def compute_split_token_index(
    split_seq_index: int,
    forward_mode: ForwardMode,
    extend_seq_lens: Sequence[int] | None,
    token_num_per_seq: int | None,
    *,
    threshold: float = DEFAULT_THRESHOLD,
) -> int:
    """The token row at which TBO splits a batch.

    Args:
      split_seq_index: from ``compute_split_seq_index``.
      forward_mode: the step's mode.
      extend_seq_lens: per-sequence new-token counts (EXTEND / MIXED).
      token_num_per_seq: tokens per sequence (DECODE / TARGET_VERIFY).
      threshold: SGLang's ``tbo_token_distribution_threshold``.

    Returns:
      ``total // 2`` for a two-chunk split, else the tokens of sequences ``[0, split_seq_index)``.

    Raises:
      ValueError: a missing argument, ``split_seq_index`` out of range, or DRAFT_EXTEND.
    """
    if forward_mode in _BALANCED_MODES:
        lengths = _check_lengths("extend_seq_lens", extend_seq_lens)
        if not 0 <= split_seq_index <= len(lengths):
            raise ValueError(f"split_seq_index={split_seq_index} outside [0, batch_size="
                             f"{len(lengths)}]")  # fmt: skip
        check_threshold(threshold)
        if _extend_split(lengths, threshold)[2]:
            return sum(lengths) // 2
        return sum(lengths[:split_seq_index])
    if forward_mode.is_decode() or forward_mode.is_target_verify():
        return split_seq_index * _check_per_seq(forward_mode, token_num_per_seq)
    if forward_mode.is_idle() or forward_mode.is_prebuilt():
        if split_seq_index != 0:
            raise ValueError(f"{forward_mode.name} splits at 0, got split_seq_index="
                             f"{split_seq_index}")  # fmt: skip
        return 0
    raise ValueError(f"TBO does not split {forward_mode.name} batches")


def compute_tbo_children_num_token_non_padded(
    split_token_index: int, num_token_non_padded: int
) -> tuple[int, int]:
    """Real tokens of children A and B when the parent has ``num_token_non_padded`` real rows.

    Args:
      split_token_index: the token split.
      num_token_non_padded: real rows of the parent (padding rows come last).

    Returns:
      ``(min(split, real), max(0, real - split))``.
    """
    return (
        min(split_token_index, num_token_non_padded),
        max(0, num_token_non_padded - split_token_index),
    )
