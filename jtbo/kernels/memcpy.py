"""DP memcpy: copy rows to or from a traced row offset (SGLang ``memcpy_triton``).

``offset_src=True`` copies ``dst[i] = src[offset + i]``; ``offset_src=False``
copies ``dst[offset + i] = src[i]``; for ``i`` in ``[0, size)``, all other rows of
``dst`` unchanged. Rows that do not exist in either buffer are dropped (the rule is
in ``jtbo.kernels.ranges``).

Kernel: the copied rows are one contiguous element range on each side, so the
kernel streams ``(hi - lo) * row_elems`` elements in blocks, one block per program,
starting at row ``lo`` of the plain side and ``offset + lo`` of the offset side
(both non-negative, which the Pallas interpreter needs: it shifts negative slice
starts). Each program loads the raw ``offset`` and ``size`` and derives ``(offset,
lo, hi)`` itself (``ranges.window_bounds``), so a call is a single launch. The grid
covers the largest possible copy (static); programs past the actual count return
at once. ``dst`` is aliased to the output, so only the copied rows are touched:
bytes moved = 2 * size * row bytes.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.kernels import copy_config, impls, ranges


def _memcpy_kernel(
    offset_ref, size_ref, src_ref, dst_in_ref, dst_ref, *, offset_src, rows, row_elems, block,
    align, evict,
):  # fmt: skip
    # offset_ref, size_ref: [1] int32; src_ref: [src_rows * row_elems];
    # dst_in_ref, dst_ref: [dst_rows * row_elems], the same buffer (aliased).
    del dst_in_ref
    off, lo, hi = ranges.window_bounds(offset_ref[0], size_ref[0], *rows)
    count = pl.multiple_of((hi - lo) * row_elems, align)
    first = pl.program_id(0) * block

    @pl.when(first < count)
    def _copy_block():
        plain = pl.multiple_of(lo * row_elems, align) + first
        shifted = pl.multiple_of((off + lo) * row_elems, align) + first
        src_start, dst_start = (shifted, plain) if offset_src else (plain, shifted)
        mask = first + jnp.arange(block, dtype=jnp.int32) < count
        vals = plgpu.load(src_ref.at[pl.ds(src_start, block)], mask=mask, eviction_policy=evict)
        plgpu.store(dst_ref.at[pl.ds(dst_start, block)], vals, mask=mask)


def _launch_shape(dst, src, offset_src, cfg):
    """(row elems, (plain rows, offset rows), block, grid, align) of one launch."""
    cols = ranges.row_elems(dst.shape)
    rows = (dst.shape[0], src.shape[0]) if offset_src else (src.shape[0], dst.shape[0])
    align = cfg.align(cols, dst.dtype.itemsize)
    block = cfg.block_for(rows[0] * cols, dst.dtype.itemsize)
    return cols, rows, block, pl.cdiv(rows[0] * cols, block), align


def dp_memcpy_pallas(dst, src, offset, size, *, offset_src, cfg, interpret):
    """Pallas impl on int32 scalars ``offset`` / ``size``; returns the new ``dst``."""
    cols, rows, block, grid, align = _launch_shape(dst, src, offset_src, cfg)
    impls.check_pallas_elems((dst.size, src.size), block)
    kernel = functools.partial(
        _memcpy_kernel, offset_src=offset_src, rows=rows, row_elems=cols, block=block,
        align=align, evict=cfg.eviction_policy,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((dst.size,), dst.dtype),
        grid=(grid,),
        input_output_aliases={3: 0},  # dst is updated in place
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(offset.reshape(1), size.reshape(1), src.reshape(-1), dst.reshape(-1))
    return out.reshape(dst.shape)


def dp_memcpy_triton(dst, src, offset, size, *, offset_src, cfg):
    """jax-triton impl on int32 scalars ``offset`` / ``size``; returns the new ``dst``."""
    from jtbo.kernels import triton_kernels  # imports triton: GPU machines only

    cols, rows, block, grid, align = _launch_shape(dst, src, offset_src, cfg)
    out = impls.jax_triton().triton_call(
        offset.reshape(1),
        size.reshape(1),
        src.reshape(-1),
        dst.reshape(-1),
        kernel=triton_kernels.dp_memcpy_kernel,
        out_shape=jax.ShapeDtypeStruct((dst.size,), dst.dtype),
        grid=(grid,),
        input_output_aliases={3: 0},  # dst is updated in place
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        PLAIN_ROWS=rows[0],
        OFFSET_ROWS=rows[1],
        ROW_ELEMS=cols,
        OFFSET_SRC=offset_src,
        BLOCK=block,
        ALIGN=align,
        EVICT=triton_kernels.eviction(cfg.eviction_policy),
    )
    return out.reshape(dst.shape)


def dp_memcpy_reference(dst, src, window, *, offset_src):
    """Plain-jnp impl (``impl="xla"``): a row gather and a dropping row scatter."""
    off, lo, hi = window[0], window[1], window[2]
    plain_rows = dst.shape[0] if offset_src else src.shape[0]
    i = jnp.arange(plain_rows, dtype=jnp.int32)
    valid = (i >= lo) & (i < hi)
    src_rows, dst_rows = (off + i, i) if offset_src else (i, off + i)
    # Invalid pairs read row 0 and write past the end, which mode="drop" discards.
    rows = jnp.take(src, jnp.where(valid, src_rows, 0), axis=0)
    return dst.at[jnp.where(valid, dst_rows, dst.shape[0])].set(rows, mode="drop")


def dp_memcpy(dst, src, offset, size, *, offset_src, impl=None, config=None):
    """Copies ``size`` rows between ``src`` and ``dst`` at a traced row ``offset``.

    ``offset_src=True``: ``dst[i] = src[offset + i]``; ``False``: ``dst[offset + i] =
    src[i]``; for ``0 <= i < size``. Pairs whose rows do not exist are dropped (see
    ``jtbo.kernels.ranges``). The kernels alias ``dst`` to the result; jit the caller
    with ``dst`` donated to skip the copy of ``dst`` at the jit boundary.

    Args:
      dst: ``[dst_rows, ...]`` array.
      src: ``[src_rows, ...]`` array, same trailing shape and dtype as ``dst``.
      offset: int32 scalar (0-d or shape (1,)), may be traced.
      size: int32 scalar (0-d or shape (1,)), may be traced.
      offset_src: True when ``offset`` indexes ``src``, False when it indexes ``dst``.
      impl: ``"xla"``, ``"pallas"``, ``"triton"`` or None (fastest available).
      config: ``CopyConfig`` for the kernels; None for the tuned default.

    Returns:
      The updated ``dst``.

    Raises:
      ValueError: mismatched trailing shapes or dtypes, bad scalars, unknown impl.
      KernelUnavailableError: the named impl cannot run on this backend.
    """
    ranges.check_pair(dst, src, "dst", "src")
    offset = ranges.as_row_scalar(offset, "offset")
    size = ranges.as_row_scalar(size, "size")
    plain, shifted = (dst, src) if offset_src else (src, dst)
    cfg = config or copy_config.DP_MEMCPY
    payload = min(plain.shape[0], shifted.shape[0]) * ranges.row_elems(dst.shape)
    impl = impls.resolve(
        impl,
        op="dp_memcpy",
        payload_bytes=payload * dst.dtype.itemsize,
        xla_below_bytes=cfg.xla_below_bytes,
    )
    if dst.size == 0 or src.size == 0:  # nothing can be copied; kernels need real buffers
        return dst
    if impl == "pallas":
        interpret = impls.backend() == "cpu"
        return dp_memcpy_pallas(
            dst, src, offset, size, offset_src=offset_src, cfg=cfg, interpret=interpret
        )
    if impl == "triton":
        return dp_memcpy_triton(dst, src, offset, size, offset_src=offset_src, cfg=cfg)
    window = ranges.copy_window(offset, size, plain.shape[0], shifted.shape[0])
    return dp_memcpy_reference(dst, src, window, offset_src=offset_src)
