"""TBO slice-and-pad: rows ``[start, start + length)`` of ``x`` into a zero buffer.

The child input of two-batch overlap (SGLang ``_model_forward_filter_inputs``):
``out[i] = x[start + i]`` for ``0 <= i < length`` where that row exists, zero for
every other row of the static ``capacity``. Out-of-range rows follow
``jtbo.kernels.ranges`` (plain side = ``out``, offset side = ``x``).

Kernel: one pass over the output. Each program owns one block of output elements,
loads the matching elements of ``x`` under a mask (masked lanes read nothing and
give zero) and stores the whole block, so every output element is written once:
bytes moved = (length + capacity) * row bytes. Loads use a gathered index vector
rather than a slice, because the block's source start may be negative (the masked
lanes) and the Pallas interpreter would shift a negative slice.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.kernels import config as config_lib
from jtbo.kernels import impls, ranges


def _slice_pad_kernel(window_ref, x_ref, out_ref, *, row_elems, out_elems, block, align):
    # window_ref: [3] int32 (offset, lo, hi); x_ref: [x_rows * row_elems];
    # out_ref: [capacity * row_elems].
    off, lo, hi = window_ref[0], window_ref[1], window_ref[2]
    first = pl.program_id(0) * block
    elem = first + jnp.arange(block, dtype=jnp.int32)
    lo_elem = pl.multiple_of(lo * row_elems, align)
    hi_elem = pl.multiple_of(hi * row_elems, align)
    mask = (elem >= lo_elem) & (elem < hi_elem)
    src = elem + pl.multiple_of(off * row_elems, align)
    vals = plgpu.load(x_ref.at[src], mask=mask, other=jnp.zeros((), x_ref.dtype))
    plgpu.store(out_ref.at[pl.ds(first, block)], vals, mask=elem < out_elems)


def _launch_shape(x, capacity, cfg):
    cols = ranges.row_elems(x.shape)
    align = cfg.align(cols, x.dtype.itemsize)
    return cols, pl.cdiv(capacity * cols, cfg.block_elems), align


def slice_pad_pallas(x, window, *, capacity, cfg, interpret):
    """Pallas impl over a precomputed ``ranges.copy_window``; returns ``[capacity, ...]``."""
    cols, grid, align = _launch_shape(x, capacity, cfg)
    out_shape = (capacity, *x.shape[1:])
    impls.check_pallas_elems((x.size, capacity * cols), cfg.block_elems)
    kernel = functools.partial(
        _slice_pad_kernel,
        row_elems=cols,
        out_elems=capacity * cols,
        block=cfg.block_elems,
        align=align,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((capacity * cols,), x.dtype),
        grid=(grid,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(window, x.reshape(-1))
    return out.reshape(out_shape)


def slice_pad_triton(x, window, *, capacity, cfg):
    """jax-triton impl over a precomputed ``ranges.copy_window``; returns ``[capacity, ...]``."""
    from jtbo.kernels import triton_kernels  # imports triton: GPU machines only

    cols, grid, align = _launch_shape(x, capacity, cfg)
    out_shape = (capacity, *x.shape[1:])
    out = impls.jax_triton().triton_call(
        window,
        x.reshape(-1),
        kernel=triton_kernels.slice_pad_kernel,
        out_shape=jax.ShapeDtypeStruct((capacity * cols,), x.dtype),
        grid=(grid,),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        ROW_ELEMS=cols,
        OUT_ELEMS=capacity * cols,
        BLOCK=cfg.block_elems,
        ALIGN=align,
    )
    return out.reshape(out_shape)


def slice_pad_reference(x, window, *, capacity):
    """Plain-jnp impl (``impl="xla"``): a row gather and a select against zero."""
    off, lo, hi = window[0], window[1], window[2]
    i = jnp.arange(capacity, dtype=jnp.int32)
    valid = (i >= lo) & (i < hi)
    rows = jnp.take(x, jnp.where(valid, off + i, 0), axis=0)
    valid = valid.reshape((capacity,) + (1,) * (x.ndim - 1))
    return jnp.where(valid, rows, jnp.zeros((), x.dtype))


def slice_pad(x, start, length, *, capacity, impl=None, config=None):
    """Rows ``[start, start + length)`` of ``x`` in a zero buffer of ``capacity`` rows.

    Args:
      x: ``[rows, ...]`` array.
      start: int32 scalar (0-d or shape (1,)), may be traced.
      length: int32 scalar (0-d or shape (1,)), may be traced.
      capacity: static row count of the result.
      impl: ``"xla"``, ``"pallas"``, ``"triton"`` or None (fastest available).
      config: ``CopyConfig`` for the kernels; None for the tuned default.

    Returns:
      ``[capacity, ...]`` array: ``out[i] = x[start + i]`` for ``i < length`` where
      that row exists, zero elsewhere.

    Raises:
      ValueError: bad ``capacity``, scalars or impl name.
      KernelUnavailableError: the named impl cannot run on this backend.
    """
    ranges.check_rows(x.shape, "x")
    capacity = ranges.check_static_rows(capacity, "capacity")
    start = ranges.as_row_scalar(start, "start")
    length = ranges.as_row_scalar(length, "length")
    impl = impls.resolve(impl)
    window = ranges.copy_window(start, length, capacity, x.shape[0])
    cfg = config or config_lib.SLICE_PAD
    if x.size == 0 or capacity == 0 or ranges.row_elems(x.shape) == 0:
        return jnp.zeros((capacity, *x.shape[1:]), x.dtype)  # nothing to copy
    if impl == "pallas":
        interpret = impls.backend() == "cpu"
        return slice_pad_pallas(x, window, capacity=capacity, cfg=cfg, interpret=interpret)
    if impl == "triton":
        return slice_pad_triton(x, window, capacity=capacity, cfg=cfg)
    return slice_pad_reference(x, window, capacity=capacity)
