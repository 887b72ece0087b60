"""GPU kernels of a few calls of a jitted function, from a ``jax.profiler`` trace.

The calls run once untraced first (compile, autotuning and first-use allocations stay out of
the trace), then ``calls`` times inside ``jax.profiler.trace``; the trace's GPU kernels are
parsed by ``jtbo.bench.kernel_time``.
"""

import glob
import tempfile
from collections.abc import Callable

import jax

from jtbo.bench import kernel_time


def trace_kernels(run: Callable[[], object], calls: int) -> list[kernel_time.Kernel]:
    """The GPU kernels of ``calls`` runs of ``run`` (after one untraced run).

    Args:
      run: a function of no arguments that enqueues the work and returns its outputs.
      calls: traced runs.

    Returns:
      The trace's GPU kernels in start order (``kernel_time.gpu_kernels``); none off GPUs.

    Raises:
      RuntimeError: the profiler wrote no trace file.
    """
    folder = tempfile.mkdtemp(prefix="jtbo_trace_")
    jax.block_until_ready(run())
    with jax.profiler.trace(folder):
        for _ in range(calls):
            out = run()
        jax.block_until_ready(out)
    paths = glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)
    if len(paths) != 1:
        raise RuntimeError(f"jax.profiler wrote {len(paths)} *.trace.json.gz under {folder}")
    return kernel_time.gpu_kernels(kernel_time.read_trace(paths[0]))
