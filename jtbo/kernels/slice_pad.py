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
lanes) and the Pallas interpreter would shift a negative slice. Each program
derives the window from the raw ``start`` / ``length`` (``ranges.window_bounds``),
so a call is a single launch.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.kernels import copy_config, impls, ranges


def _slice_pad_kernel(start_ref, length_ref, x_ref, out_ref, *, rows, row_elems, block, align,
                      evict):  # fmt: skip
    # start_ref, length_ref: [1] int32; x_ref: [x_rows * row_elems];
    # out_ref: [capacity * row_elems].
    off, lo, hi = ranges.window_bounds(start_ref[0], length_ref[0], *rows)
    first = pl.program_id(0) * block
    elem = first + jnp.arange(block, dtype=jnp.int32)
    lo_elem = pl.multiple_of(lo * row_elems, align)
    hi_elem = pl.multiple_of(hi * row_elems, align)
    mask = (elem >= lo_elem) & (elem < hi_elem)
    src = elem + pl.multiple_of(off * row_elems, align)
    zero = jnp.zeros((), x_ref.dtype)
    vals = plgpu.load(x_ref.at[src], mask=mask, other=zero, eviction_policy=evict)
    plgpu.store(out_ref.at[pl.ds(first, block)], vals, mask=elem < rows[0] * row_elems)


def _launch_shape(x, capacity, cfg):
    """(row elems, (capacity, x rows), block, grid, align) of one launch."""
    cols = ranges.row_elems(x.shape)
    align = cfg.align(cols, x.dtype.itemsize)
    block = cfg.block_for(capacity * cols, x.dtype.itemsize)
    return cols, (capacity, x.shape[0]), block, pl.cdiv(capacity * cols, block), align


def slice_pad_pallas(x, start, length, *, capacity, cfg, interpret):
    """Pallas impl on int32 scalars ``start`` / ``length``; returns ``[capacity, ...]``."""
    cols, rows, block, grid, align = _launch_shape(x, capacity, cfg)
    impls.check_pallas_elems((x.size, capacity * cols), block)
    kernel = functools.partial(
        _slice_pad_kernel, rows=rows, row_elems=cols, block=block, align=align,
        evict=cfg.eviction_policy,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((capacity * cols,), x.dtype),
        grid=(grid,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(start.reshape(1), length.reshape(1), x.reshape(-1))
    return out.reshape((capacity, *x.shape[1:]))


def slice_pad_triton(x, start, length, *, capacity, cfg):
    """jax-triton impl on int32 scalars ``start`` / ``length``; returns ``[capacity, ...]``."""
    from jtbo.kernels import triton_kernels  # imports triton: GPU machines only

    cols, rows, block, grid, align = _launch_shape(x, capacity, cfg)
    out = impls.jax_triton().triton_call(
        start.reshape(1),
        length.reshape(1),
        x.reshape(-1),
        kernel=triton_kernels.slice_pad_kernel,
        out_shape=jax.ShapeDtypeStruct((capacity * cols,), x.dtype),
        grid=(grid,),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        PLAIN_ROWS=rows[0],
        OFFSET_ROWS=rows[1],
        ROW_ELEMS=cols,
        BLOCK=block,
        ALIGN=align,
        EVICT=triton_kernels.eviction(cfg.eviction_policy),
    )
    return out.reshape((capacity, *x.shape[1:]))


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
    impl = impls.resolve(impl, op="slice_pad")
    cfg = config or copy_config.SLICE_PAD
    if x.size == 0 or capacity == 0 or ranges.row_elems(x.shape) == 0:
        return jnp.zeros((capacity, *x.shape[1:]), x.dtype)  # nothing to copy
    if impl == "pallas":
        interpret = impls.backend() == "cpu"
        return slice_pad_pallas(x, start, length, capacity=capacity, cfg=cfg, interpret=interpret)
    if impl == "triton":
        return slice_pad_triton(x, start, length, capacity=capacity, cfg=cfg)
    window = ranges.copy_window(start, length, capacity, x.shape[0])
    return slice_pad_reference(x, window, capacity=capacity)
