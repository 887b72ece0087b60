"""Host page table of every DP rank: which KV-pool slot holds each (request, position).

The runner owns it (SGLang's ``req_to_token_pool``): before a step, every new token's slot
(``out_cache_loc``) is recorded at its KV position — ``prefix + i`` for extend rows,
``seq_len - 1`` for a decode row, ``seq_len + i`` for the i-th draft token of a verify row —
and the whole table travels to the device with the step.
"""

import numpy as np

from jtbo import split
from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode


def kv_positions(batch: split.ForwardBatch) -> tuple[np.ndarray, np.ndarray]:
    """Request row and KV position of every token of a host batch.

    Args:
      batch: an unpadded host batch.

    Returns:
      ``(req_rows [num_tokens], positions [num_tokens])``.

    Raises:
      ValueError: a mode without KV writes or a missing field.
    """
    mode = batch.forward_mode
    if mode.is_idle() or batch.batch_size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    req = np.asarray(batch.req_pool_indices, np.int64)
    seq_lens = np.asarray(batch.seq_lens, np.int64)
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        new = np.asarray(batch.extend_seq_lens, np.int64)
        prefix = np.asarray(batch.extend_prefix_lens, np.int64)
        rows = np.repeat(req, new)
        offsets = np.arange(rows.shape[0]) - np.repeat(np.cumsum(new) - new, new)
        return rows, np.repeat(prefix, new) + offsets
    if mode.is_decode():
        return req, seq_lens - 1
    if mode.is_target_verify():
        draft = batch.spec_info.draft_token_num
        return np.repeat(req, draft), np.repeat(seq_lens, draft) + np.tile(
            np.arange(draft), len(req)
        )
    raise ValueError(f"forward_mode {mode.name} is not served by the runner")


def record(table: np.ndarray, batch: split.ForwardBatch, num_slots: int) -> None:
    """Writes a batch's new-token slots into one rank's ``[max_reqs, max_context]`` table.

    Raises:
      ValueError: a request row, position or slot outside the table / pool (names the numbers).
    """
    rows, positions = kv_positions(batch)
    if rows.size == 0:
        return
    slots = np.asarray(batch.out_cache_loc, np.int64)
    if rows.max() >= table.shape[0] or rows.min() < 0:
        raise ValueError(f"req_pool_indices max {rows.max()} outside [0, {table.shape[0]})")
    if positions.max() >= table.shape[1]:
        raise ValueError(f"KV position {positions.max()} >= max_context {table.shape[1]}")
    if slots.min() < 1 or slots.max() >= num_slots:
        raise ValueError(
            f"out_cache_loc range [{slots.min()}, {slots.max()}] outside [1, {num_slots}) "
            "(slot 0 is the padding slot)"
        )
    table[rows, positions] = slots
