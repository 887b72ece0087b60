"""Triton kernels for the ``"triton"`` impl (run through jax-triton).

Imported only when that impl runs: ``import triton`` needs a GPU build. The kernels
do what the Pallas kernels beside their wrappers do (see ``memcpy``, ``slice_pad``,
``merge``), with addresses in 64 bits as SGLang's ``memcpy_triton`` has them: each
program loads the int32 window ``(offset, lo, hi)`` and streams ``BLOCK`` elements.
``ALIGN`` is the element multiple every row start has; ``tl.multiple_of`` tells the
compiler so, which lets it issue vector loads although the offsets are runtime values.
"""

import triton
import triton.language as tl


@triton.jit
def _window(window_ptr, ROW_ELEMS: tl.constexpr, ALIGN: tl.constexpr):
    off = tl.load(window_ptr).to(tl.int64) * ROW_ELEMS
    lo = tl.load(window_ptr + 1).to(tl.int64) * ROW_ELEMS
    hi = tl.load(window_ptr + 2).to(tl.int64) * ROW_ELEMS
    return tl.multiple_of(off, ALIGN), tl.multiple_of(lo, ALIGN), tl.multiple_of(hi, ALIGN)


@triton.jit
def dp_memcpy_kernel(
    window_ptr,  # [3] int32: offset, lo, hi (rows)
    src_ptr,  # [src_rows * ROW_ELEMS]
    dst_in_ptr,  # [dst_rows * ROW_ELEMS], aliased to dst_ptr
    dst_ptr,  # [dst_rows * ROW_ELEMS]
    ROW_ELEMS: tl.constexpr,
    OFFSET_SRC: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    off, lo, hi = _window(window_ptr, ROW_ELEMS, ALIGN)
    count = hi - lo
    first = tl.program_id(0).to(tl.int64) * BLOCK
    if first < count:
        lanes = first + tl.arange(0, BLOCK)
        mask = lanes < count
        if OFFSET_SRC:
            vals = tl.load(src_ptr + (off + lo) + lanes, mask=mask)
            tl.store(dst_ptr + lo + lanes, vals, mask=mask)
        else:
            vals = tl.load(src_ptr + lo + lanes, mask=mask)
            tl.store(dst_ptr + (off + lo) + lanes, vals, mask=mask)


@triton.jit
def slice_pad_kernel(
    window_ptr,  # [3] int32: offset, lo, hi (rows)
    x_ptr,  # [x_rows * ROW_ELEMS]
    out_ptr,  # [capacity * ROW_ELEMS]
    ROW_ELEMS: tl.constexpr,
    OUT_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    off, lo, hi = _window(window_ptr, ROW_ELEMS, ALIGN)
    elem = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (elem >= lo) & (elem < hi)
    vals = tl.load(x_ptr + off + elem, mask=mask, other=0)
    tl.store(out_ptr + elem, vals, mask=elem < OUT_ELEMS)


@triton.jit
def merge_pair_kernel(
    windows_ptr,  # [2, 3] int32: offset, lo, hi (rows) of part a, then of part b
    a_ptr,  # [a_rows * ROW_ELEMS]
    b_ptr,  # [b_rows * ROW_ELEMS]
    base_ptr,  # [OUT_ELEMS]: earlier parts' merge (aliased to out_ptr) when HAS_BASE
    out_ptr,  # [OUT_ELEMS]
    ROW_ELEMS: tl.constexpr,
    OUT_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    HAS_BASE: tl.constexpr,
):
    elem = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_out = elem < OUT_ELEMS
    if HAS_BASE:
        acc = tl.load(base_ptr + elem, mask=in_out)
    else:
        acc = tl.zeros((BLOCK,), out_ptr.dtype.element_ty)
    off, lo, hi = _window(windows_ptr, ROW_ELEMS, ALIGN)
    mask = (elem >= off + lo) & (elem < off + hi)
    acc = tl.where(mask, tl.load(a_ptr + (elem - off), mask=mask), acc)
    off, lo, hi = _window(windows_ptr + 3, ROW_ELEMS, ALIGN)
    mask = (elem >= off + lo) & (elem < off + hi)
    acc = tl.where(mask, tl.load(b_ptr + (elem - off), mask=mask), acc)
    tl.store(out_ptr + elem, acc, mask=in_out)
