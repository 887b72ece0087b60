"""The logits rows a sampler reads: each sequence's last token of the step.

A serving loop samples one next token per sequence, from the logits of that sequence's last
token in the step. ``ModelRunner.forward(batches, logits="last")`` plans its step with those
rows (``planning.assemble(picked=...)``): ``last_rows`` names each sequence's row on the host
and ``row_index`` pads every rank's rows to one static width (the step's sequence bound, which
every process agrees on) as the step's ``logit_rows`` input. The step then runs the LM head on
those rows only (``jtbo.models.step``) and returns ``[dp, width, vocab]``: a 4096-token
prefill over a 32768-word vocabulary computes and reads back ``[num_seqs, vocab]`` float32
per DP rank instead of ``[4096, vocab]`` (512 MiB).
"""

import numpy as np

from jtbo import split

LOGITS_MODES = ("all", "last")
"""``ModelRunner.forward(logits=...)``: every token's row, or each sequence's last one."""


def check_mode(logits: str) -> None:
    """Raises ValueError unless ``logits`` is one of ``LOGITS_MODES``."""
    if logits not in LOGITS_MODES:
        raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")


def last_rows(batch: split.ForwardBatch) -> np.ndarray:
    """``[batch_size]`` int32 row of each sequence's last token in the step, in batch order.

    Args:
      batch: one rank's host batch (extend-like or decode).

    Returns:
      Decode: every row (one token per sequence). Extend: ``extend_start_loc +
      extend_seq_lens - 1``. Idle: no row.

    Raises:
      ValueError: a target-verify batch (its sampler reads every draft row), another mode
        without per-sequence rows, or a sequence with no new token.
    """
    mode = batch.forward_mode
    if mode.is_idle():
        return np.zeros(0, np.int32)
    if mode.is_target_verify():
        raise ValueError("logits='last' has one row per sequence; a TARGET_VERIFY batch needs "
                         "every draft row: use logits='all'")  # fmt: skip
    if mode.is_decode():
        return np.arange(batch.batch_size, dtype=np.int32)
    if not mode.is_extend():
        raise ValueError(f"logits='last' takes extend or decode batches, not {mode.name}")
    lens = np.asarray(batch.extend_seq_lens, np.int64)
    if (lens < 1).any():
        raise ValueError(f"logits='last': every sequence needs a new token, got {lens.tolist()}")
    return (np.asarray(batch.extend_start_loc, np.int64) + lens - 1).astype(np.int32)


def row_index(rows: list[np.ndarray], width: int) -> np.ndarray:
    """``[len(rows), width]`` int32: each rank's rows, padded with row 0.

    Args:
      rows: per rank, the rows to read (an idle rank: an empty array).
      width: the static width (the step's sequence bound).

    Raises:
      ValueError: a rank with more rows than ``width``.
    """
    index = np.zeros((len(rows), width), np.int32)
    for rank, picked in enumerate(rows):
        if len(picked) > width:
            raise ValueError(f"{len(picked)} sequences on one rank exceed the bound {width}")
        index[rank, : len(picked)] = picked
    return index
