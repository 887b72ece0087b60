"""The correctness check: every program's output against its numpy reference, once."""

import jax
import numpy as np

from jtbo.bench.overlap import inputs as inputs_lib
from jtbo.bench.overlap import reference as reference_lib
from jtbo.bench.overlap import sizes as sizes_lib

TOLERANCE = {"bfloat16": 2**-5, "float32": 2**-7}
"""Max |got - want| allowed, relative to max |want|: bf16 (or TF32) rounding per step, summed
in another order, stays well inside; a misplaced block or a wrong op does not."""


def check_close(what: str, got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    """Checks a program's output against its reference.

    Args:
      what: names the program and output in the error.
      got: the device's values.
      want: the reference, same shape.
      dtype: ``--dtype``, which sets the tolerance (``TOLERANCE``).

    Raises:
      RuntimeError: shapes differ, or ``max |got - want| > TOLERANCE * max |want|`` (or NaN).
    """
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got.shape != want.shape:
        raise RuntimeError(f"{what}: shape {got.shape}, the reference's {want.shape}")
    error, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
    if not error <= TOLERANCE[dtype] * scale:
        raise RuntimeError(
            f"{what}: max |got - want| = {error:.4g} exceeds {TOLERANCE[dtype]} x max |want| "
            f"({scale:.4g}); the program does not compute its numpy reference"
        )


def _local_columns(array: jax.Array, rows: int, k: int) -> dict[int, np.ndarray]:
    """Mesh position -> first ``k`` columns of that device's block, for this process's
    devices (another process checks its own)."""
    return {
        inputs_lib.position(shard.index, rows): np.asarray(shard.data[:, :k])
        for shard in array.addressable_shards
    }


def _check_comm(what: str, out: jax.Array, want: np.ndarray, dtype: str) -> None:
    for position, got in _local_columns(out, want.shape[1], want.shape[2]).items():
        check_close(f"{what} (device {position})", got, want[position], dtype)


def _check_matmul(
    what: str, out: jax.Array, expected: reference_lib.Expected, sizes: sizes_lib.ProbeSizes
) -> None:
    position = expected.matmul_position
    shard = next(s for s in out.addressable_shards
                 if inputs_lib.position(s.index, sizes.matmul) == position)  # fmt: skip
    got = np.asarray(shard.data[0])
    check_close(f"{what} (device {expected.matmul_position}, row 0)", got,
                expected.matmul_row, sizes.dtype)  # fmt: skip


def check_programs(
    name: str, outputs: dict, expected: reference_lib.Expected, sizes: sizes_lib.ProbeSizes
) -> None:
    """Checks the comm, compute and both programs' outputs once (``Expected``).

    Raises:
      RuntimeError: an output differs from its reference.
    """
    both_comm, both_compute = outputs["both"]
    _check_comm(f"{name}: comm alone", outputs["comm"], expected.comm, sizes.dtype)
    _check_comm(f"{name}: both, collective chain", both_comm, expected.comm, sizes.dtype)
    _check_matmul(f"{name}: compute alone", outputs["compute"], expected, sizes)
    _check_matmul(f"{name}: both, matmul chain", both_compute, expected, sizes)
