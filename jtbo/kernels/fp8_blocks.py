"""Block-scaled FP8 weights: ``float8_e4m3fn`` values and one float32 scale per block.

A weight ``w`` is cut into blocks of ``block_shape`` (one size per axis, 1 on an axis that
blocks do not span; the last block along an axis is shorter when the axis is not a multiple
of its size). Block ``b`` gets the scale ``s_b = max |w_b| / 448`` (448 is e4m3fn's largest
finite value; computed as a multiply by the float32 ``1 / 448``; an all-zero block gets 1)
and the values ``q = round_e4m3(w / s_b)``: the block's largest magnitude lands on 448, so
no value overflows, and ``q * s_b`` is the weight again up to e4m3's rounding. This is
DeepSeek-V3's published scheme: its ``[out, in]`` weights in 128 x 128 blocks,
``weight_scale_inv`` holding ``s``.

Rounding bound, per element: e4m3 keeps 3 mantissa bits, so round-to-nearest moves a value
of normal magnitude (``|w / s| >= 2**-6``) by at most ``2**-4`` of itself; below that the
values are subnormal, spaced ``2**-9`` apart, so the error is at most ``2**-10`` times the
block's scale. Together: ``|q * s - w| <= max(2**-4 * |w|, 2**-10 * s)``.

``BlockQuantized`` holds a quantized weight (a pytree: values and scales are its leaves, the
block shape static). ``quantize_blocks`` / ``dequantize_blocks`` work on jax arrays (they
trace under jit); ``quantize_blocks_host`` / ``block_scales_host`` are the same arithmetic in
numpy for the host (a checkpoint quantized while it loads). ``quantize_blocks_reference`` and
``dequantize_blocks_reference`` are the definitions, block by block in float64 loops.

The routed experts' weights (``w_gate_up [E, H, 2, F]``, ``w_down [E, F, H]``) are blocked
over their contraction and output axes only (``expert_block_shape``): blocks of
``(1, block_k, 1, block_n)`` and ``(1, block_k, block_n)``, the checkpoint's blocks of each
expert's gate, up and down matrices, transposed.

Stored axis order. A ``BlockQuantized`` may keep its values and scales in another order than
the weight's axes (``axes``: stored axis ``i`` is the weight's axis ``axes[i]``); ``shape``
and ``block_shape`` stay the weight's. The routed experts store theirs contraction-last
(``expert_axes``: ``[E, 2, F, H]`` and ``[E, H, F]``, each expert's matrices ``[out, in]`` as
the checkpoint has them), the order an FP8 tensor-core dot reads its operands in
(``jtbo.kernels.grouped_gemm``).
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jtbo.core import arith

FP8_DTYPE = jnp.float8_e4m3fn
"""The values' dtype."""
FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value: each block's largest magnitude maps to it."""
INV_FP8_MAX = np.float32(1.0 / FP8_MAX)
"""``1 / FP8_MAX`` in float32: scales are a block's largest magnitude times it (a multiply, as
XLA computes a division by a constant, so numpy and jax give the same bits)."""
DEFAULT_BLOCK = (128, 128)
"""``(contraction, output)`` block of DeepSeek-V3's published FP8 weights."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockQuantized:
    """A weight as block-scaled FP8: ``values * scales`` expanded over each block.

    ``check`` validates the fields (the constructor does not, since pytree code builds
    instances with placeholder leaves).
    """

    values: jax.Array  # [*shape in `axes` order] float8_e4m3fn
    scales: jax.Array  # [*ceil(shape / block_shape) in `axes` order] float32, one per block
    block_shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    # Stored axis i holds the weight's axis axes[i]; None: the weight's own order.
    axes: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def stored_axes(self) -> tuple[int, ...]:
        """``axes``, or the identity order for None."""
        return tuple(range(self.values.ndim)) if self.axes is None else self.axes

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape (its axes' order, whatever the stored one)."""
        return _unpermute(tuple(self.values.shape), self.stored_axes)

    @property
    def ndim(self) -> int:
        """The weight's rank."""
        return len(self.values.shape)

    @property
    def dtype(self) -> jnp.dtype:
        """The values' dtype (``float8_e4m3fn``)."""
        return self.values.dtype

    @property
    def stored_block_shape(self) -> tuple[int, ...]:
        """``block_shape`` in the stored order (the blocks of ``values``)."""
        return tuple(self.block_shape[axis] for axis in self.stored_axes)

    def check(self) -> None:
        """Raises ValueError when the fields do not fit together (names the field, the
        expected and the found values)."""
        if sorted(self.stored_axes) != list(range(self.ndim)):
            raise ValueError(f"axes {self.axes} must order the {self.ndim} axes of the values")
        if len(self.block_shape) != self.ndim or min(self.block_shape, default=1) < 1:
            raise ValueError(
                f"block_shape {self.block_shape} must give a positive size for each of the "
                f"{self.ndim} axes of values {self.shape}"
            )
        if jnp.dtype(self.values.dtype) != jnp.dtype(FP8_DTYPE):
            raise ValueError(f"values must be {jnp.dtype(FP8_DTYPE)}, got {self.values.dtype}")
        want = scales_shape(tuple(self.values.shape), self.stored_block_shape)
        if tuple(self.scales.shape) != want or jnp.dtype(self.scales.dtype) != jnp.float32:
            raise ValueError(
                f"scales must be float32 {list(want)} for blocks {self.stored_block_shape} of "
                f"values {list(self.values.shape)}, got {self.scales.dtype} "
                f"{list(self.scales.shape)}"
            )


def _unpermute(stored: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    """The weight-order tuple whose ``axes`` order is ``stored``."""
    out = [0] * len(stored)
    for position, axis in enumerate(axes):
        out[axis] = stored[position]
    return tuple(out)


def inverse_axes(axes: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes ``axes`` (``transpose(transpose(x, axes), inverse)``)."""
    return _unpermute(tuple(range(len(axes))), axes)


def expert_axes(ndim: int) -> tuple[int, ...]:
    """The stored order of a stacked expert weight: its contraction axis (1) last.

    Args:
      ndim: the weight's rank (4 for ``w_gate_up [E, H, 2, F]``, 3 for ``w_down [E, F, H]``).

    Returns:
      ``(0, 2, 3, 1)`` (stored ``[E, 2, F, H]``) or ``(0, 2, 1)`` (stored ``[E, H, F]``).
    """
    return (0, *range(2, ndim), 1)


def expert_matrices(w: BlockQuantized, out_dim: int, in_dim: int, impl: str):
    """An expert weight stored contraction-last as matrices, the order the FP8 kernels read.

    Args:
      w: ``w_gate_up`` (``out_dim = 2F``: the gate rows, then the up rows) or ``w_down``.
      out_dim: each expert's output rows.
      in_dim: each expert's contraction.
      impl: the kernels' impl, named in the error.

    Returns:
      ``(values [E, out_dim, in_dim], scales [E, out blocks, in blocks])``.

    Raises:
      ValueError: ``w`` stored in another order than ``expert_axes``.
    """
    if w.axes != expert_axes(w.ndim):
        raise ValueError(
            f"impl={impl!r} reads FP8 expert weights stored contraction-last (axes "
            f"{expert_axes(w.ndim)}, fp8_blocks.expert_axes), got axes {w.axes}"
        )
    num_experts = w.values.shape[0]
    values = w.values.reshape(num_experts, out_dim, in_dim)
    return values, w.scales.reshape(num_experts, -1, w.scales.shape[-1])


def scales_shape(shape: tuple[int, ...], block_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Blocks along each axis: ``ceil(shape / block_shape)``."""
    return tuple(
        arith.ceil_div(size, block) for size, block in zip(shape, block_shape, strict=True)
    )


def expert_block_shape(ndim: int, block: tuple[int, int]) -> tuple[int, ...]:
    """The block shape of a stacked expert weight: ``block = (contraction, output)`` over axes
    1 and -1, 1 on the expert axis and any axis between (``w_gate_up``'s gate / up axis).

    Args:
      ndim: the weight's rank (4 for ``w_gate_up [E, H, 2, F]``, 3 for ``w_down [E, F, H]``).
      block: ``(block_k, block_n)``.

    Returns:
      E.g. ``(1, block_k, 1, block_n)`` for ``ndim`` 4.
    """
    return (1, block[0]) + (1,) * (ndim - 3) + (block[1],)


def quantize_experts(w: jax.Array, block: tuple[int, int] = DEFAULT_BLOCK) -> BlockQuantized:
    """A stacked expert weight as FP8 in ``(contraction, output)`` blocks, stored
    contraction-last (``expert_block_shape``, ``expert_axes``), as the models keep it.

    Args:
      w: ``w_gate_up [E, H, 2, F]`` or ``w_down [E, F, H]``.
      block: ``(block_k, block_n)``.

    Returns:
      The ``BlockQuantized`` weight.
    """
    return quantize_blocks(w, expert_block_shape(w.ndim, block), axes=expert_axes(w.ndim))


def _padded_blocks(x, block_shape: tuple[int, ...], xp):
    """``x`` zero-padded to whole blocks and reshaped ``[n0, b0, n1, b1, ...]``."""
    blocks = scales_shape(x.shape, block_shape)
    pad = [(0, n * b - size) for n, b, size in zip(blocks, block_shape, x.shape, strict=True)]
    padded = xp.pad(x, pad)
    return padded.reshape([d for pair in zip(blocks, block_shape, strict=True) for d in pair])


def _expand(scales, shape: tuple[int, ...], block_shape: tuple[int, ...], xp):
    """``scales`` repeated over their blocks and cut to ``shape``."""
    for axis, block in enumerate(block_shape):
        if block > 1:
            scales = xp.repeat(scales, block, axis=axis)
    return scales[tuple(slice(0, size) for size in shape)]


def _scales(x, block_shape: tuple[int, ...], xp):
    """float32 ``max |block| / FP8_MAX`` of each block (1 for an all-zero block)."""
    blocks = _padded_blocks(xp.abs(x.astype(xp.float32)), block_shape, xp)
    amax = blocks.max(axis=tuple(range(1, blocks.ndim, 2)))
    # A multiply by the float32 reciprocal, not a division: XLA turns a division by a constant
    # into that multiply, and numpy then gives the same bits.
    return xp.where(amax > 0, amax * INV_FP8_MAX, xp.float32(1.0)).astype(xp.float32)


def _quantize(x, block_shape: tuple[int, ...], xp, fp8_dtype):
    scales = _scales(x, block_shape, xp)
    values = x.astype(xp.float32) / _expand(scales, x.shape, block_shape, xp)
    return values.astype(fp8_dtype), scales


def _check_block_shape(shape, block_shape) -> tuple[int, ...]:
    block_shape = tuple(int(b) for b in block_shape)
    if len(block_shape) != len(shape) or min(block_shape, default=1) < 1:
        raise ValueError(
            f"block_shape {block_shape} must give a positive size for each axis of {tuple(shape)}"
        )
    return block_shape


def quantize_blocks(
    x: jax.Array, block_shape: tuple[int, ...], axes: tuple[int, ...] | None = None
) -> BlockQuantized:
    """Block-scaled FP8 of a float weight (module docstring; traceable).

    Args:
      x: the weight, any float dtype and shape.
      block_shape: a block size per axis of ``x``.
      axes: the stored order of the values and scales (``BlockQuantized.axes``); None keeps
        ``x``'s.

    Returns:
      The ``BlockQuantized`` weight.

    Raises:
      ValueError: a block shape that does not fit ``x``, axes that do not order its axes,
        or a non-float ``x``.
    """
    block_shape = _check_block_shape(x.shape, block_shape)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantize_blocks takes a float weight, got {x.dtype}")
    if axes is not None and sorted(axes) != list(range(x.ndim)):
        raise ValueError(f"axes {axes} must order the {x.ndim} axes of {tuple(x.shape)}")
    values, scales = _quantize_jit(jnp.asarray(x), block_shape)
    if axes is not None:
        values, scales = jnp.transpose(values, axes), jnp.transpose(scales, axes)
    return BlockQuantized(values, scales, block_shape, None if axes is None else tuple(axes))


def quantize_rows(x: jax.Array, group: int) -> BlockQuantized:
    """Activations as FP8: each row of ``x [N, K]`` in groups of ``group`` columns (blocks of
    ``(1, group)``), from the values ``x`` holds in its own dtype.

    XLA may keep a producer's float32 values where the program rounds them to ``x.dtype``
    (it drops a float32 -> bf16 -> float32 pair: ``xla_allow_excess_precision``); the scales
    and values would then depend on how the program is fused (a layer's output rounded or
    not before the next layer quantizes it). An optimization barrier makes ``x`` a value of
    its own dtype first, as ``quantize_blocks`` defines the quantization.

    Args:
      x: ``[N, K]`` float rows.
      group: columns per quantization group.

    Returns:
      The ``BlockQuantized`` rows: values ``[N, K]``, scales ``[N, ceil(K / group)]``.

    Raises:
      ValueError: as ``quantize_blocks``.
    """
    return quantize_blocks(jax.lax.optimization_barrier(x), (1, group))


@functools.partial(jax.jit, static_argnums=1)
def _quantize_jit(x, block_shape):
    """``_quantize`` as one program (called eagerly, e.g. at a model's init, its many small
    ops would each dispatch on their own)."""
    return _quantize(x, block_shape, jnp, FP8_DTYPE)


def dequantize_blocks(w: BlockQuantized, dtype=jnp.float32) -> jax.Array:
    """``values * scale`` of each element's block, computed in float32, returned in ``dtype``.

    Args:
      w: the quantized weight.
      dtype: the result's dtype.

    Returns:
      ``w.shape`` (the weight's axis order, whatever the stored one) in ``dtype``.
    """
    w.check()
    stored = tuple(w.values.shape)
    scales = _expand(w.scales, stored, w.stored_block_shape, jnp)
    out = (w.values.astype(jnp.float32) * scales).astype(dtype)
    return out if w.axes is None else jnp.transpose(out, inverse_axes(w.axes))


def fake_quantize_rows(x: jax.Array, group: int) -> jax.Array:
    """``x`` through FP8 and back: each row's ``group`` columns (the last axis) quantized with
    their own scale (``quantize_blocks`` in ``(1, ..., group)`` blocks) and dequantized.

    Args:
      x: ``[..., K]`` float rows.
      group: columns per scale (the last group is shorter when K is not a multiple).

    Returns:
      ``x.shape`` in float32.
    """
    block = (1,) * (x.ndim - 1) + (group,)
    return dequantize_blocks(quantize_blocks(x, block), jnp.float32)


def quantize_blocks_host(x: np.ndarray, block_shape: tuple[int, ...]):
    """``quantize_blocks`` in numpy, on the host.

    Args:
      x: a float weight.
      block_shape: a block size per axis.

    Returns:
      ``(values float8_e4m3fn, scales float32)``, numpy arrays.

    Raises:
      ValueError: a block shape that does not fit ``x``.
    """
    block_shape = _check_block_shape(x.shape, block_shape)
    return _quantize(np.asarray(x), block_shape, np, ml_dtypes.float8_e4m3fn)


def block_scales_host(x: np.ndarray, block_shape: tuple[int, ...]) -> np.ndarray:
    """The scales ``quantize_blocks_host`` gives ``x``, without its values (numpy, float32)."""
    return _scales(np.asarray(x), _check_block_shape(x.shape, block_shape), np)


def _block_slices(shape, block_shape):
    """``(block index, slices of x)`` of every block, in C order."""
    counts = scales_shape(shape, block_shape)
    for index in itertools.product(*(range(n) for n in counts)):
        yield (
            index,
            tuple(
                slice(i * b, min((i + 1) * b, size))
                for i, b, size in zip(index, block_shape, shape, strict=True)
            ),
        )


def quantize_blocks_reference(x: np.ndarray, block_shape: tuple[int, ...]):
    """The definition of ``quantize_blocks``: one block at a time, its largest magnitude in
    float64 times the float32 ``1 / 448``, each value divided by the block's float32 scale and
    rounded to e4m3.

    Returns:
      ``(values float8_e4m3fn, scales float32)``, numpy arrays.
    """
    x = np.asarray(x, np.float64)
    values = np.zeros(x.shape, ml_dtypes.float8_e4m3fn)
    scales = np.zeros(scales_shape(x.shape, block_shape), np.float32)
    for index, part in _block_slices(x.shape, block_shape):
        amax = np.abs(x[part]).max()
        scales[index] = np.float32(amax) * INV_FP8_MAX if amax > 0 else 1.0
        values[part] = (x[part].astype(np.float32) / scales[index]).astype(values.dtype)
    return values, scales


def dequantize_blocks_reference(
    values: np.ndarray, scales: np.ndarray, block_shape: tuple[int, ...]
) -> np.ndarray:
    """The definition of ``dequantize_blocks``: each block's values times its scale, float64."""
    out = np.zeros(values.shape, np.float64)
    for index, part in _block_slices(values.shape, block_shape):
        out[part] = values[part].astype(np.float64) * np.float64(scales[index])
    return out
