"""How DP ranks' token buffers are padded before they are gathered (SGLang ``DpPaddingMode``).

Gathering every DP rank's tokens onto every device (for a TP MLP / MoE in FULL scatter mode)
can be done two ways:

* MAX_LEN: every rank pads its tokens to the largest rank's count and the padded buffers are
  all-gathered; rank ``r``'s rows start at ``r * max_len``. Communication ~ ``dp * max_len``.
* SUM_LEN: every rank writes its rows at its prefix-sum offset of a zeroed ``sum_len`` buffer
  and the buffers are all-reduced. Communication ~ ``2 * sum_len`` (an all-reduce moves twice
  its buffer), which wins when counts are uneven.

The rule (SGLang's ``DpPaddingMode.get_dp_padding_mode``, ported as
``select_dp_padding_mode``): a batch with an extend (prefill) step on any rank and ``dp > 1``
uses SUM_LEN, since prefill counts are very uneven; otherwise the cheaper mode by that cost
model, MAX_LEN on a tie (``sum * 2 >= max * dp``). SGLang replays CUDA graphs in MAX_LEN only;
here both modes are jitted per bucket (the SUM_LEN length is bucketed,
``jtbo.collectives.context.sum_len_bucket``), and the runner's planner applies the rule per
step where the SUM_LEN buffer is the smaller.
"""

import enum
from collections.abc import Sequence


class DpPaddingMode(enum.IntEnum):
    """Layout of the gathered DP buffer: MAX_LEN (all-gather) or SUM_LEN (all-reduce)."""

    MAX_LEN = 1
    SUM_LEN = 2

    def is_max_len(self) -> bool:
        """True for MAX_LEN."""
        return self is DpPaddingMode.MAX_LEN

    def is_sum_len(self) -> bool:
        """True for SUM_LEN."""
        return self is DpPaddingMode.SUM_LEN


def select_dp_padding_mode(
    is_extend_in_batch: bool, global_num_tokens: Sequence[int]
) -> DpPaddingMode:
    """Picks the DP padding mode of a step (SGLang's rule, module docstring).

    Args:
      is_extend_in_batch: whether any DP rank runs an extend step.
      global_num_tokens: tokens of each DP rank (its length is ``dp_size``).

    Returns:
      The padding mode.

    Raises:
      ValueError: ``global_num_tokens`` is empty or holds a negative count.
    """
    counts = [int(n) for n in global_num_tokens]
    if not counts or min(counts) < 0:
        raise ValueError(f"global_num_tokens={counts} must be non-empty and non-negative")
    dp_size = len(counts)
    if is_extend_in_batch and dp_size > 1:
        return DpPaddingMode.SUM_LEN
    # Ties go to MAX_LEN: its fixed-size all-gather buffers are symmetric across ranks.
    if sum(counts) * 2 >= max(counts) * dp_size:
        return DpPaddingMode.MAX_LEN
    return DpPaddingMode.SUM_LEN
