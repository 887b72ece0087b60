"""Shared test helpers: independent numpy references, random data, poisoning, impl lists."""

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import kernels

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32)
TRAILING = ((), (3,), (2, 5))
# Tiny blocks so the kernels run multi-program grids on tiny test shapes.
SMALL = kernels.CopyConfig(block_elems=16, num_warps=1)


def impls_here() -> tuple[str, ...]:
    """The impls this backend must serve: all three on a GPU, xla and pallas on the CPU."""
    return kernels.IMPLS if jax.default_backend() == "gpu" else ("xla", "pallas")


def random_rows(rng: np.random.Generator, rows: int, trailing, dtype) -> np.ndarray:
    """Random non-zero data of ``[rows, *trailing]`` in ``dtype`` (numpy)."""
    shape = (rows, *trailing)
    if jnp.issubdtype(dtype, jnp.integer):
        return rng.integers(1, 2**20, size=shape).astype(dtype)
    return (rng.standard_normal(shape) + 3.0).astype(dtype)


def poison_device_memory(nbytes: int = 1 << 22) -> None:
    """Fills and frees a device buffer so fresh outputs start from garbage, not zeros."""
    junk = jnp.full((nbytes // 4,), 0x7FC0DEAD, jnp.uint32)
    junk.block_until_ready()
    del junk


def pairs(offset: int, size: int, plain_rows: int, offset_rows: int):
    """(plain row, offset row) pairs that the documented rule copies, by brute force."""
    for i in range(max(size, 0)):
        if 0 <= i < plain_rows and 0 <= offset + i < offset_rows:
            yield i, offset + i


def memcpy_np(dst, src, offset, size, offset_src):
    """numpy reference of ``dp_memcpy``."""
    out = np.array(dst, copy=True)
    plain, shifted = (dst, src) if offset_src else (src, dst)
    for i, j in pairs(offset, size, plain.shape[0], shifted.shape[0]):
        if offset_src:
            out[i] = src[j]
        else:
            out[j] = src[i]
    return out


def slice_pad_np(x, start, length, capacity):
    """numpy reference of ``slice_pad``."""
    out = np.zeros((capacity, *x.shape[1:]), x.dtype)
    for i, j in pairs(start, length, capacity, x.shape[0]):
        out[i] = x[j]
    return out


def merge_np(parts, starts, lengths, out_len):
    """numpy reference of ``merge_rows``."""
    out = np.zeros((out_len, *parts[0].shape[1:]), parts[0].dtype)
    for part, start, length in zip(parts, starts, lengths, strict=True):
        for j, r in pairs(start, length, part.shape[0], out_len):
            out[r] = part[j]
    return out


def assert_equal(actual, expected) -> None:
    """Bit-exact comparison (copies must not change values)."""
    np.testing.assert_array_equal(np.asarray(actual), expected)
