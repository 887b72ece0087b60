"""The page table of every DP rank: which KV-pool slot holds each (request, position).

The runner owns it (SGLang's ``req_to_token_pool``) and keeps it on the devices. Every new
token's slot (``out_cache_loc``) is recorded at its KV position — ``prefix + i`` for extend
rows, ``seq_len - 1`` for a decode row, ``seq_len + i`` for the i-th draft token of a verify
row. The host computes only those writes (``page_writes``: a step's tokens, never the table)
and the step scatters them into the device table before attention reads it
(``jtbo.models.step_io.write_pages``); ``record`` applies the same writes to a numpy table, the
host reference.

A row's positions that were never recorded hold slot 0, the padding slot, which every padding
row of a step writes; attention over them would read whatever was written last. So the runner
also keeps, per request row, how many leading positions are recorded (``filled``), and refuses
a batch that writes a row past them (``check_context``): e.g. a decode of a request whose
prompt never went through this runner (record its context first with an EXTEND batch). A
batch that writes a row from position 0 starts a new request there.
"""

import numpy as np

from jtbo import split
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.models import step_io
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
    return _token_positions(*write_ranges(batch))


def _token_positions(req, starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """``kv_positions`` from ``write_ranges``' result."""
    new = ends - starts
    rows = np.repeat(req, new)
    offsets = np.arange(rows.shape[0]) - np.repeat(np.cumsum(new) - new, new)
    return rows, np.repeat(starts, new) + offsets


def write_ranges(batch: split.ForwardBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Request row and ``[start, end)`` KV positions each request of a host batch writes.

    Returns:
      ``(req_rows [batch_size], starts [batch_size], ends [batch_size])``.

    Raises:
      ValueError: a mode without KV writes.
    """
    mode = batch.forward_mode
    if mode.is_idle() or batch.batch_size == 0:
        return (np.zeros(0, np.int64),) * 3
    req = np.asarray(batch.req_pool_indices, np.int64)
    seq_lens = np.asarray(batch.seq_lens, np.int64)
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        prefix = np.asarray(batch.extend_prefix_lens, np.int64)
        return req, prefix, prefix + np.asarray(batch.extend_seq_lens, np.int64)
    if mode.is_decode():
        return req, seq_lens - 1, seq_lens
    if mode.is_target_verify():
        return req, seq_lens, seq_lens + batch.spec_info.draft_token_num
    raise ValueError(f"forward_mode {mode.name} is not served by the runner")


def check_context(filled: np.ndarray, batch: split.ForwardBatch) -> None:
    """Refuses a batch that would attend over KV positions never recorded.

    Args:
      filled: ``[max_reqs]`` recorded leading positions per request row of the rank.
      batch: the host batch about to be recorded.

    Raises:
      ValueError: a request row written from a position past its recorded context (names
        the row and both numbers).
    """
    _check_ranges(filled, *write_ranges(batch))


def _check_ranges(filled, rows, starts, _) -> None:
    """``check_context`` on ``write_ranges``' result."""
    if rows.size and (rows.min() < 0 or rows.max() >= filled.shape[0]):
        raise ValueError(
            f"req_pool_indices span [{rows.min()}, {rows.max()}], outside [0, {filled.shape[0]})"
        )
    gap = (starts > 0) & (starts > filled[rows])
    if gap.any():
        row = int(np.flatnonzero(gap)[0])
        raise ValueError(
            f"request row {rows[row]} writes KV positions from {starts[row]} but only "
            f"positions [0, {filled[rows[row]]}) of it are recorded: its attention would read "
            "the padding slot; record the request's context first (an EXTEND batch)"
        )


def page_writes(
    batch: split.ForwardBatch,
    table_shape: tuple[int, int],
    num_slots: int,
    filled: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checks a batch's new-token slots against one rank's table and returns the writes.

    The work is the batch's tokens': nothing here reads or copies the table.

    Args:
      batch: an unpadded host batch.
      table_shape: the rank's page table ``(max_reqs, max_context)``.
      num_slots: KV-pool slots of the rank (slot 0 is the padding slot).
      filled: the rank's ``[max_reqs]`` recorded leading positions (``check_context``), checked
        and updated; None skips the check.

    Returns:
      ``(rows, positions, slots)``, each ``[num_tokens]`` int64: ``table[rows, positions] =
      slots`` records the batch.

    Raises:
      ValueError: a request row, position or slot outside the table / pool (names the numbers),
        or (with ``filled``) a write past a row's recorded context.
    """
    ranges = write_ranges(batch)
    if filled is not None:
        _check_ranges(filled, *ranges)
    rows, positions = _token_positions(*ranges)
    slots = np.asarray(batch.out_cache_loc if rows.size else [], np.int64)
    if rows.size == 0:
        return rows, positions, slots
    if rows.max() >= table_shape[0] or rows.min() < 0:
        raise ValueError(
            f"req_pool_indices span [{rows.min()}, {rows.max()}], outside [0, {table_shape[0]})"
        )
    if positions.max() >= table_shape[1]:
        raise ValueError(f"KV position {positions.max()} >= max_context {table_shape[1]}")
    if slots.min() < 1 or slots.max() >= num_slots:
        raise ValueError(
            f"out_cache_loc range [{slots.min()}, {slots.max()}] outside [1, {num_slots}) "
            "(slot 0 is the padding slot)"
        )
    _check_distinct_slots(slots)
    if filled is not None:
        req, starts, ends = ranges
        filled[req] = np.where(starts == 0, ends, np.maximum(filled[req], ends))
    return rows, positions, slots


def record(
    table: np.ndarray, batch: split.ForwardBatch, num_slots: int, filled: np.ndarray | None = None
) -> None:
    """Writes a batch's new-token slots into one rank's numpy ``[max_reqs, max_context]``
    table (the host reference of the device table; ``page_writes`` has the checks).

    Raises:
      ValueError: what ``page_writes`` raises.
    """
    rows, positions, slots = page_writes(batch, table.shape, num_slots, filled)
    table[rows, positions] = slots


def write_rows(batch: split.ForwardBatch, capacity: int) -> np.ndarray:
    """A step's ``page_writes`` input: ``[3, capacity]`` int32 request row, KV position and
    slot per token row (``jtbo.models.step_io.write_pages``).

    Token rows past the batch, and rows whose slot is the padding slot (the runner's warm-up
    batches), name ``step_io.DROPPED_ROW`` and write nothing. The batch was checked when it
    was recorded (``page_writes``).
    """
    out = np.zeros((3, capacity), np.int32)
    out[0] = step_io.DROPPED_ROW
    if batch.forward_mode.is_idle() or batch.batch_size == 0:
        return out
    rows, positions = kv_positions(batch)
    slots = np.asarray(batch.out_cache_loc, np.int64)
    n = rows.shape[0]
    out[0, :n] = np.where(slots == kv_cache_lib.PADDING_SLOT, step_io.DROPPED_ROW, rows)
    out[1, :n], out[2, :n] = positions, slots
    return out


def _check_distinct_slots(slots: np.ndarray) -> None:
    """Two new tokens of one batch (of one request or of two) must not share a KV slot."""
    order = np.argsort(slots, kind="stable")
    same = np.flatnonzero(slots[order][1:] == slots[order][:-1])
    if same.size:
        first, second = sorted(int(i) for i in order[same[0] : same[0] + 2])
        raise ValueError(
            f"out_cache_loc gives slot {slots[first]} to token rows {first} and {second}: "
            "a KV slot holds one token (the later write would overwrite the other request's K/V)"
        )
