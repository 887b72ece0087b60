"""The numpy references: what each program's output should hold, computed on the host from
the same random inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench.overlap import collectives as collectives_lib
from jtbo.bench.overlap import inputs as inputs_lib
from jtbo.bench.overlap import sizes as sizes_lib

CHECK_COLUMNS = 4
"""Columns of each collective's result compared with the numpy reference."""


def _rounded(x: np.ndarray, dtype) -> np.ndarray:
    """``x`` rounded to ``dtype`` as the device stores it, back in float32."""
    return np.asarray(x, dtype=dtype).astype(np.float32)


def comm_reference(
    collective: collectives_lib.Collective, x: np.ndarray, chain: int, dtype
) -> np.ndarray:
    """The collective chain on the host.

    Args:
      collective: the probed collective.
      x: ``(ndev, rows, k)`` inputs, some leading columns of each device's block.
      chain: collectives in the chain.
      dtype: the device dtype (each step's result is rounded to it).

    Returns:
      ``(ndev, rows, k)`` float32: what each device should hold after the chain.
    """
    x = x.astype(np.float32)
    for _ in range(chain):
        x = _rounded(collective.reference(x), dtype)
    return x


def matmul_reference(y_row: np.ndarray, w: np.ndarray, steps: int, dtype) -> np.ndarray:
    """Row 0 of ``y @ w @ w ...`` (``steps`` matmuls), rounded to ``dtype`` after each."""
    row, w = y_row.astype(np.float32), w.astype(np.float32)
    for _ in range(steps):
        row = _rounded(row @ w, dtype)
    return row


@dataclasses.dataclass(frozen=True)
class MatmulCheck:
    """Host copies of the matmul inputs of the one device whose first row is checked."""

    position: int
    y_row: np.ndarray  # row 0 of y, as the device holds it
    w: np.ndarray  # float32 of the device's w


def matmul_check(y: jax.Array, sizes: sizes_lib.ProbeSizes, seed: int) -> MatmulCheck:
    """Made once per measurement: every collective's matmul chain starts from them."""
    dtype, n = jnp.dtype(sizes.dtype), sizes.matmul
    position = inputs_lib.position(y.addressable_shards[0].index, n)
    y_row = inputs_lib.matmul_block(seed, inputs_lib.Y_STREAM, position, n, dtype)[0]
    w = inputs_lib.matmul_block(seed, inputs_lib.W_STREAM, position, n, dtype)
    return MatmulCheck(position, y_row, w.astype(np.float32))


@dataclasses.dataclass(frozen=True)
class Expected:
    """The references one collective's three programs are checked against."""

    comm: np.ndarray  # (ndev, rows, CHECK_COLUMNS)
    matmul_position: int  # the device whose first matmul row is checked
    matmul_row: np.ndarray


def expected(collective, sizes, ndev: int, seed: int, matmuls: int, check: MatmulCheck):
    """The ``Expected`` outputs of one collective's programs (``matmuls`` per window)."""
    dtype, rows = jnp.dtype(sizes.dtype), sizes_lib.comm_input_rows(collective, sizes, ndev)
    columns = np.stack([
        inputs_lib.device_block(seed, inputs_lib.COMM_STREAM, p, (rows, CHECK_COLUMNS), dtype)
        for p in range(ndev)
    ])  # fmt: skip
    row = matmul_reference(check.y_row, check.w, sizes.chain * matmuls, dtype)
    return Expected(comm_reference(collective, columns, sizes.chain, dtype), check.position, row)
