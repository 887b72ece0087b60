"""Device-synchronised timing and the calibration of the matmul count per window."""

import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jtbo.bench.overlap import programs as programs_lib

WARMUP_RUNS = 2
CALIBRATION_RUNS = 3
"""Timed runs of the one-matmul-per-window program that sets the matmul count."""
MAX_MATMULS_PER_WINDOW = 256
"""More would unroll thousands of matmuls into one program; use a larger ``--matmul``."""


def median_seconds(runs: Sequence[Callable[[], object]], iters: int) -> list[float]:
    """Median seconds of each run, device-synchronised.

    Args:
      runs: zero-argument callables returning jax arrays.
      iters: timed runs of each, after ``WARMUP_RUNS``; the runs take turns.

    Returns:
      One median per run, in order.
    """
    for run in runs:
        for _ in range(WARMUP_RUNS):
            jax.block_until_ready(run())
    times = [[] for _ in runs]
    for _ in range(iters):
        for column, run in zip(times, runs, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(run())
            column.append(time.perf_counter() - start)
    return [statistics.median(column) for column in times]


def balanced_matmuls_per_window(comm_s: float, matmul_s: float) -> int:
    """Matmuls that take about as long as one collective.

    Args:
      comm_s: seconds of one collective (with its elementwise step).
      matmul_s: seconds of one matmul.

    Returns:
      ``round(comm_s / matmul_s)``, at least 1.

    Raises:
      ValueError: a time that is not positive, or more than ``MAX_MATMULS_PER_WINDOW``.
    """
    if comm_s <= 0 or matmul_s <= 0:
        raise ValueError(f"times must be positive, got {comm_s}, {matmul_s}")
    count = max(1, round(comm_s / matmul_s))
    if count > MAX_MATMULS_PER_WINDOW:
        raise ValueError(
            f"{count} matmuls per window (collective {comm_s * 1e3:.3f} ms, matmul "
            f"{matmul_s * 1e3:.3f} ms) exceeds {MAX_MATMULS_PER_WINDOW}: raise --matmul or "
            "set --matmuls-per-window"
        )
    return count


def _same_on_every_process(count: int) -> int:
    """Process 0's count everywhere: every process must compile the same programs."""
    if jax.process_count() == 1:
        return count
    from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process only

    return int(multihost_utils.broadcast_one_to_all(np.int32(count)))


def calibrate_matmuls_per_window(run_comm, collective, mesh, sizes, inputs, options) -> int:
    """Balances the matmul count to the collective (``balanced_matmuls_per_window``).

    Args:
      run_comm: runs the comm-alone program (``--chain`` collectives).
      collective, mesh, sizes, inputs, options: as for ``probe.probe_collective``.

    Returns:
      Process 0's count, on every process (they must compile the same programs).
    """
    run_compute = programs_lib.programs(
        collective, mesh, sizes.chain, 1, inputs, options, ["compute"]
    )
    comm_s, compute_s = median_seconds([run_comm, run_compute["compute"]], CALIBRATION_RUNS)
    return _same_on_every_process(balanced_matmuls_per_window(comm_s, compute_s))
