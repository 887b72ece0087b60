"""The device's measured rates: what a benchmark's results are compared against.

* **Copy bandwidth**: bytes read + written per second by a plain device copy of ``nbytes``
  (torch's ``copy_`` where torch sees the GPU, else XLA's ``x + 1``): the ceiling of a
  memory-bound kernel and the rate of a decode step's weight and KV reads.
* **Dense matmul rate**: FLOP/s of one bf16 ``[n, n] @ [n, n]`` matmul: the rate of a
  compute-bound step's useful work.

Each is the median over ``reps`` batches of back-to-back calls, measured in the benchmark's
own process, so ratios against it compare figures of one run.
"""

import statistics
import time

import jax
import jax.numpy as jnp

from jtbo.bench import kernels as kernels_bench


def time_fn(fn, args, *, warmup: int, iters: int, reps: int) -> float:
    """Median seconds per call of ``fn(*args)`` over ``reps`` batches of ``iters`` calls.

    Args:
      fn: a jitted function.
      args: its arguments.
      warmup: untimed calls first (compiles).
      iters: back-to-back calls per batch (the batch waits for the last one).
      reps: batches.

    Returns:
      Seconds per call.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def time_fns_interleaved(cases, *, warmup: int, iters: int, reps: int) -> list[float]:
    """Median seconds per call of each ``fn(*args)`` in ``cases``, timed in turns.

    Each rep times one batch of ``iters`` calls of every case, one case after the other, so
    the cases share the GPU's state (its clock falls as it heats under matmuls: docs/benchmarks/,
    "the clock falls under load"), and a ratio of two medians compares like with like.

    Args:
      cases: ``(fn, args)`` pairs, each a jitted function and its arguments.
      warmup: untimed calls of each first (compiles).
      iters: back-to-back calls per batch.
      reps: batches of each.

    Returns:
      Seconds per call of each case, in order.
    """
    for fn, args in cases:
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times = [[] for _ in cases]
    for _ in range(reps):
        for case_times, (fn, args) in zip(times, cases, strict=True):
            start = time.perf_counter()
            for _ in range(iters):
                out = fn(*args)
            jax.block_until_ready(out)
            case_times.append((time.perf_counter() - start) / iters)
    return [statistics.median(case_times) for case_times in times]


def copy_gbs(nbytes: int, *, iters: int, reps: int) -> tuple[float, str]:
    """(GB/s read + written, label) of a device copy of ``nbytes`` on the default device.

    Args:
      nbytes: bytes copied per call.
      iters: calls per timed batch.
      reps: timed batches.

    Returns:
      The rate and how it was measured ("torch copy_" or "XLA x + 1").
    """
    if kernels_bench.torch_usable():
        seconds = kernels_bench.torch_copy_seconds(nbytes, iters, reps)
        return 2 * nbytes / seconds / 1e9, "torch copy_"
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    add_one = jax.jit(lambda x: x + jnp.bfloat16(1))
    seconds = time_fn(add_one, (x,), warmup=1, iters=iters, reps=reps)
    return 2 * nbytes / seconds / 1e9, "XLA x + 1"


def matmul_tflops(n: int, *, iters: int, reps: int) -> float:
    """TF/s of a bf16 ``[n, n] @ [n, n]`` matmul on the default device.

    Args:
      n: the matrices' size (8192 keeps an H200's tensor cores busy).
      iters: calls per timed batch.
      reps: timed batches.

    Returns:
      ``2 n^3`` FLOPs over the median seconds per call, in units of 1e12.
    """
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(jnp.dot)
    seconds = time_fn(matmul, (a, b), warmup=1, iters=iters, reps=reps)
    return 2 * n**3 / seconds / 1e12
