"""Splitting an EAGLE verify input (``SpecVerifyInput``) along with its batch.

Token fields (draft tokens, their positions) take the child's token rows; per-sequence fields
(retrieve tables, prefix lengths) take its sequence range. The custom mask is a flat
concatenation of per-sequence blocks of ``(seq_len + draft_token_num) * draft_token_num``
entries, so a sequence range ``[s0, s1)`` owns entries ``[offset(s0), offset(s1))`` where
``offset`` is the exclusive prefix sum of the block sizes (SGLang ``_compute_mask_offset``).
Unlike SGLang, an empty sequence range gets an empty mask slice rather than the whole mask.
"""

import numpy as np

from jtbo.split import batch as batch_lib


def _slice(value, start: int, end: int):
    return None if value is None else value[start:end]


def split_spec_info(
    spec_info: batch_lib.SpecVerifyInput | None,
    *,
    start_seq_index: int,
    end_seq_index: int,
    start_token_index: int,
    end_token_index: int,
) -> batch_lib.SpecVerifyInput | None:
    """The part of ``spec_info`` that belongs to one TBO child.

    Args:
      spec_info: the parent's verify input, or None.
      start_seq_index: first sequence of the child.
      end_seq_index: one past the child's last sequence.
      start_token_index: first token row of the child.
      end_token_index: one past the child's last token row.

    Returns:
      A new ``SpecVerifyInput`` (the parent is unchanged), or None.

    Raises:
      ValueError: a custom mask without ``seq_lens`` (its per-sequence offsets are unknown).
    """
    if spec_info is None:
        return None
    custom_mask = spec_info.custom_mask
    if custom_mask is not None:
        if spec_info.seq_lens is None:
            raise ValueError("spec_info.custom_mask cannot be split without spec_info.seq_lens")
        offsets = batch_lib.custom_mask_offsets(
            np.asarray(spec_info.seq_lens), spec_info.draft_token_num
        )
        custom_mask = custom_mask[int(offsets[start_seq_index]) : int(offsets[end_seq_index])]
    seq_fields = {
        name: _slice(getattr(spec_info, name), start_seq_index, end_seq_index)
        for name in batch_lib.SPEC_SEQ_FIELDS
    }
    token_fields = {
        name: _slice(getattr(spec_info, name), start_token_index, end_token_index)
        for name in batch_lib.SPEC_TOKEN_FIELDS
    }
    # Derived from a validated input; ForwardBatch tests validate the result.
    return batch_lib.replace_derived(
        spec_info, custom_mask=custom_mask, **seq_fields, **token_fields
    )
