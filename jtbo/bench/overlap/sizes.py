"""The sizes of one measurement: ``--bytes`` as buffer rows, platform defaults resolved."""

import argparse
import dataclasses

import jax.numpy as jnp

from jtbo.bench.overlap import collectives as collectives_lib

COLUMNS = 512
"""Elements per buffer row: collectives split and join rows, never columns."""
ACCELERATOR_DEFAULTS = (448 * 2**20, 8192)  # (--bytes, --matmul)
CPU_DEFAULTS = (256 * 2**10, 128)


@dataclasses.dataclass(frozen=True)
class ProbeSizes:
    """The sizes of one measurement, defaults resolved for the platform."""

    bytes_per_exchange: int
    rows: int  # rows of the --bytes buffer per device (COLUMNS elements each)
    matmul: int
    chain: int
    iters: int
    dtype: str
    matmuls_per_window: int | None  # None: calibrate


def buffer_rows(bytes_per_exchange: int, ndev: int, itemsize: int) -> int:
    """Rows of ``COLUMNS`` elements in a ``bytes_per_exchange`` buffer.

    Args:
      bytes_per_exchange: ``--bytes``.
      ndev: devices in the mesh (the buffer is cut into ``ndev`` row blocks).
      itemsize: bytes per element of ``--dtype``.

    Returns:
      The row count, a positive multiple of ``ndev``.

    Raises:
      ValueError: the bytes are not a positive multiple of ``ndev * COLUMNS * itemsize``.
    """
    quantum = ndev * COLUMNS * itemsize
    if bytes_per_exchange <= 0 or bytes_per_exchange % quantum:
        raise ValueError(
            f"--bytes {bytes_per_exchange} must be a positive multiple of {ndev} devices x "
            f"{COLUMNS} columns x {itemsize} bytes per element = {quantum}"
        )
    return bytes_per_exchange // (COLUMNS * itemsize)


def resolve_sizes(args: argparse.Namespace, platform: str, ndev: int) -> ProbeSizes:
    """The sizes of a measurement, unset ones from the platform's defaults.

    Raises:
      ValueError: ``--bytes`` not a valid multiple (``buffer_rows``).
    """
    default_bytes, default_matmul = CPU_DEFAULTS if platform == "cpu" else ACCELERATOR_DEFAULTS
    itemsize = jnp.dtype(args.dtype).itemsize
    quantum = ndev * COLUMNS * itemsize
    size = args.bytes if args.bytes is not None else max(default_bytes // quantum, 1) * quantum
    return ProbeSizes(
        bytes_per_exchange=size, rows=buffer_rows(size, ndev, itemsize),
        matmul=args.matmul or default_matmul, chain=args.chain, iters=args.iters,
        dtype=args.dtype, matmuls_per_window=args.matmuls_per_window,
    )  # fmt: skip


def comm_input_rows(collective: collectives_lib.Collective, sizes: ProbeSizes, ndev: int) -> int:
    """Rows per device of the collective chain's input (all-gather: ``1/ndev`` of them)."""
    return sizes.rows // ndev if collective.input_is_shard else sizes.rows
