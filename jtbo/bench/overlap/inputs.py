"""The random inputs: per-device blocks in [1, 2) (collectives) or matmul operands, built on
the host and placed per local device, so they work across processes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtbo.bench.overlap import collectives as collectives_lib
from jtbo.bench.overlap import sizes as sizes_lib

COMM_STREAM, Y_STREAM, W_STREAM = 0, 1, 2  # random streams of the inputs


def device_block(
    seed: int, stream: int, position: int, shape: tuple[int, int], dtype
) -> np.ndarray:
    """The random input block of mesh position ``position``, values in [1, 2).

    Generated column by column, so ``device_block(..., (rows, k), ...)`` equals the first
    ``k`` columns of any wider block: the reference regenerates only what it checks.
    """
    rows, columns = shape
    block = np.random.default_rng([seed, stream, position]).random((columns, rows), np.float32)
    block += 1
    # Cast before transposing: the strided copy then moves 2-byte elements, not 4-byte ones.
    return np.ascontiguousarray(block.astype(dtype).T)


def position(index: tuple[slice, ...], rows: int) -> int:
    """Mesh position of the device holding global rows ``index[0]`` (``rows`` per device)."""
    return (index[0].start or 0) // rows


def sharded_input(mesh, rows: int, columns: int, make_block) -> jax.Array:
    """A ``(ndev * rows, columns)`` array, block ``p`` = ``make_block(p)`` on position ``p``;
    built per local device, so it works across processes."""
    sharding = NamedSharding(mesh, P(collectives_lib.PROBE_AXIS))
    return jax.make_array_from_callback(
        (mesh.size * rows, columns), sharding, lambda index: make_block(position(index, rows))
    )


def comm_input(mesh, rows: int, seed: int, dtype) -> jax.Array:
    """The collective chain's input: ``rows`` rows of ``COLUMNS`` per device."""
    columns = sizes_lib.COLUMNS
    return sharded_input(mesh, rows, columns, lambda p: device_block(
        seed, COMM_STREAM, p, (rows, columns), dtype))  # fmt: skip


def matmul_block(seed: int, stream: int, position: int, n: int, dtype) -> np.ndarray:
    """``y`` (``Y_STREAM``, in [-1, 1)) or ``w`` (``W_STREAM``) of one device. ``w`` has
    mean 0 and variance 1/n, so its spectral radius is about 1 and the chain (a power
    iteration) grows slowly, more slowly at larger n; an
    overflow would show as a failed check, not a wrong pass."""
    block = np.random.default_rng([seed, stream, position]).random((n, n), np.float32)
    shift, scale = (0.5, 2.0) if stream == Y_STREAM else (0.5, math.sqrt(12 / n))
    block -= shift  # in place: a 8192 x 8192 block is 256 MiB in float32
    block *= scale
    return block.astype(dtype)


def matmul_inputs(mesh, sizes: sizes_lib.ProbeSizes, seed: int) -> tuple[jax.Array, jax.Array]:
    """``(y, w)``: each device's ``--matmul`` square operands."""
    dtype, n = jnp.dtype(sizes.dtype), sizes.matmul
    return tuple(
        sharded_input(mesh, n, n, lambda p, s=stream: matmul_block(seed, s, p, n, dtype))
        for stream in (Y_STREAM, W_STREAM)
    )
