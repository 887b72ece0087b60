"""Exchange of every process's plan-defining integers before a multi-process step.

A multi-process step is one SPMD program: if one process refuses its batch while the others
enter the program, they wait in its first collective forever. So before any device work every
process publishes one small int32 table (``multihost_utils.process_allgather``) holding:

* a header: DP size, the runner's exchange count (processes must call ``forward`` in
  lockstep), a fingerprint of its planning options and model (bucket lists, TBO switch,
  threshold, mesh shape, ...), and an error code;
* one row per DP rank it drives: its ``RankSummary`` (mode, tokens, draft size, split
  indices, sequences); rows of other processes' ranks are zero;
* the UTF-8 bytes of its local error message, if its batches were refused.

Every process then checks the same gathered table the same way: any refused batch or any
header mismatch raises on every process (the refusing process re-raises its own exception;
the others raise one naming that process and its message). Otherwise the rank rows, taken
from each rank's owner, are the inputs of ``planning.decide``, so every process plans the same
step. One process (a single-controller runner) skips the collective but runs the same checks.
"""

import dataclasses
import zlib
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jtbo.runner import planning

ForwardMode = planning.ForwardMode
MESSAGE_BYTES = 512
_HEADER = ("dp_size", "exchange", "fingerprint", "error")
_ROW = 6  # mode, num_tokens, draft_token_num, split_seq_index, split_token_index, num_seqs
_NO_ERROR, _VALUE_ERROR, _OTHER_ERROR = 0, 1, 2


class StepRejectedError(ValueError):
    """Another process refused its part of the step (its batches or its runner set-up)."""


class ProcessFailedError(RuntimeError):
    """Another process failed with an unexpected (non-ValueError) error before the step."""


@dataclasses.dataclass(frozen=True)
class LocalReport:
    """What this process contributes to one exchange.

    Attributes:
      exchange: how many exchanges this runner did before (the lockstep counter).
      fingerprint: ``fingerprint`` of the runner's planning set-up.
      summaries: this process's ranks' summaries by DP rank (empty when ``error`` is set).
      error: the exception that refused this process's batches, or None.
    """

    exchange: int
    fingerprint: int
    summaries: dict[int, planning.RankSummary]
    error: BaseException | None = None


def fingerprint(*parts) -> int:
    """A 31-bit checksum of the ``repr`` of a runner's planning set-up (same on every process).

    Args:
      *parts: values whose ``repr`` is deterministic (frozen dataclasses, tuples, numbers).

    Returns:
      A non-negative int32.
    """
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _optional(value: int | None) -> int:
    return -1 if value is None else int(value)


def encode(report: LocalReport, dp_size: int) -> np.ndarray:
    """The int32 table of one process (see the module docstring).

    Args:
      report: this process's report.
      dp_size: DP ranks of the mesh.

    Returns:
      ``[len(_HEADER) + dp_size * _ROW + MESSAGE_BYTES]`` int32.
    """
    error = report.error
    kind = _NO_ERROR if error is None else _VALUE_ERROR
    if error is not None and not isinstance(error, ValueError):
        kind = _OTHER_ERROR
    header = [dp_size, report.exchange, report.fingerprint, kind]
    rows = np.zeros((dp_size, _ROW), np.int32)
    for rank, s in report.summaries.items():
        rows[rank] = [
            int(s.forward_mode), s.num_tokens, _optional(s.draft_token_num),
            _optional(s.split_seq_index), _optional(s.split_token_index), _optional(s.num_seqs),
        ]  # fmt: skip
    message = np.zeros(MESSAGE_BYTES, np.int32)
    if error is not None:
        text = f"{type(error).__name__}: {error}".encode()[:MESSAGE_BYTES]
        message[: len(text)] = np.frombuffer(text, np.uint8)
    return np.concatenate([np.asarray(header, np.int32), rows.reshape(-1), message])


def _message(table: np.ndarray) -> str:
    raw = table[-MESSAGE_BYTES:].astype(np.uint8).tobytes().rstrip(b"\0")
    return raw.decode(errors="replace")


def _raise_errors(gathered: np.ndarray, own_error: BaseException | None) -> None:
    failed = [p for p in range(gathered.shape[0]) if gathered[p, 3] != _NO_ERROR]
    if not failed:
        return
    if own_error is not None:
        raise own_error
    text = "; ".join(f"process {p}: {_message(gathered[p])}" for p in failed)
    if any(gathered[p, 3] == _OTHER_ERROR for p in failed):
        raise ProcessFailedError(f"the step failed on another process: {text}")
    raise StepRejectedError(f"another process refused the step: {text}")


def _check_headers(gathered: np.ndarray) -> None:
    for column, name in enumerate(_HEADER[:3]):
        values = gathered[:, column].tolist()
        if len(set(values)) != 1:
            raise StepRejectedError(
                f"processes disagree on {name}: {values} (by process); every process must build "
                "its runner with the same options and mesh and call forward in lockstep"
            )


def decode_summaries(
    gathered: np.ndarray, owners: Sequence[int], own_error: BaseException | None = None
) -> list[planning.RankSummary]:
    """Checks the gathered tables and returns every DP rank's summary, in rank order.

    Args:
      gathered: ``[num_processes, table]`` int32, one ``encode`` table per process.
      owners: per DP rank, the process that drives it.
      own_error: this process's own refusal (re-raised as is).

    Returns:
      One ``RankSummary`` per DP rank, taken from its owner's table.

    Raises:
      StepRejectedError: another process refused its batches or disagrees on the set-up.
      ProcessFailedError: another process failed unexpectedly.
      Exception: ``own_error``, when set.
    """
    _raise_errors(gathered, own_error)
    _check_headers(gathered)
    header = len(_HEADER)
    summaries = []
    for rank, owner in enumerate(owners):
        row = gathered[owner, header + rank * _ROW :][:_ROW].tolist()
        mode, tokens, optional = row[0], row[1], [None if v < 0 else v for v in row[2:]]
        summaries.append(planning.RankSummary(ForwardMode(mode), tokens, *optional))
    return summaries


def exchange(report: LocalReport, owners: Sequence[int]) -> list[planning.RankSummary]:
    """Publishes this process's report, gathers everyone's, checks them (module docstring).

    Every process of the run must call this once per step, also when its batches were refused.

    Args:
      report: this process's report.
      owners: per DP rank, the process that drives it (``distributed.dp_rank_owners``).

    Returns:
      One ``RankSummary`` per DP rank, the same on every process.

    Raises:
      As ``decode_summaries``.
    """
    table = encode(report, len(owners))
    if jax.process_count() == 1:
        gathered = table[None]
    else:
        gathered = np.asarray(multihost_utils.process_allgather(table))
    return decode_summaries(gathered.reshape(jax.process_count(), -1), owners, report.error)
