"""``--profile DIR``: traces of the comm-alone and both programs and, on a GPU, how much
communication ran under compute kernels and how busy the GPUs were
(``jtbo.bench.kernel_time``)."""

import glob
import os
from collections.abc import Callable

import jax

from jtbo.bench import kernel_time

PROFILE_RUNS = 3
PROFILED_PROGRAMS = ("comm", "both")
"""The programs ``--profile`` traces: the span of comm alone against its kernels' busy time
shows the exchange's fixed costs, both shows the overlap."""


def _latest_trace(folder: str) -> str:
    traces = sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))
    if not traces:
        raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {folder}")
    return traces[-1]  # a reused folder holds older runs under earlier timestamps


def profile_program(run: Callable[[], object], directory: str, label: str) -> list[str]:
    """Traces ``PROFILE_RUNS`` runs of a program into ``directory/label/process_I``.

    Returns:
      Lines to print: on a GPU the NCCL time under compute kernels and the busy times
      (``jtbo.bench.kernel_time``), elsewhere where the trace went.
    """
    folder = os.path.join(directory, label, f"process_{jax.process_index()}")
    jax.block_until_ready(run())
    with jax.profiler.trace(folder):
        for _ in range(PROFILE_RUNS):
            jax.block_until_ready(run())
    if jax.devices()[0].platform != "gpu":
        return [f"{label}: traces written to {folder} (NCCL attribution needs a GPU trace)"]
    return nccl_lines(kernel_time.read_trace(_latest_trace(folder)), label)


def nccl_lines(trace: dict, label: str) -> list[str]:
    """What a GPU trace of ``PROFILE_RUNS`` runs of one program says about overlap.

    Args:
      trace: the parsed trace (``kernel_time.read_trace``), holding only those runs (the
        warm-up ran before it), so every kernel counts: NCCL kernels need not carry the
        module's name.
      label: the line prefix.

    Returns:
      The share of NCCL kernel time that ran under compute kernels
      (``kernel_time.communication_summary``), the busy times per run, and the compute
      kernels that took the most time (what a comm-alone program computes besides its
      exchanges).
    """
    kernels = kernel_time.gpu_kernels(trace)
    return [
        f"{label}: {kernel_time.communication_summary(kernels)}",
        f"{label}: {kernel_time.busy_summary(kernels, PROFILE_RUNS)}",
        f"{label}: {kernel_time.largest_compute_kernels(kernels, PROFILE_RUNS)}",
    ]
