"""Triton kernels for the ``"triton"`` impl (run through jax-triton).

Imported only when that impl runs: ``import triton`` needs a GPU build. The kernels
do what the Pallas kernels beside their wrappers do (see ``memcpy``, ``slice_pad``,
``merge``), with addresses in 64 bits as SGLang's ``memcpy_triton`` has them: each
program loads the raw int32 ``offset`` and ``size``, derives ``(offset, lo, hi)`` with
``_window`` (a transcription of ``ranges.window_bounds``, so every impl drops the same
rows) and streams ``BLOCK`` elements. ``ALIGN`` is the element multiple every row
start has; ``tl.multiple_of`` tells the compiler so, which lets it issue vector loads
although the offsets are runtime values. ``EVICT`` selects the loads' cache hint
(``eviction``), a constexpr so each policy compiles its own kernel.
"""

import triton
import triton.language as tl

_EVICTION_CODES = {None: 0, "evict_first": 1, "evict_last": 2}


def eviction(policy: str | None) -> int:
    """The ``EVICT`` constexpr of a ``CopyConfig.eviction_policy``."""
    return _EVICTION_CODES[policy]


@triton.jit
def _window(
    offset_ptr,
    size_ptr,
    PLAIN_ROWS: tl.constexpr,
    OFFSET_ROWS: tl.constexpr,
    ROW_ELEMS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    # ranges.window_bounds, then rows -> elements in 64 bits.
    off = tl.minimum(tl.maximum(tl.load(offset_ptr), -PLAIN_ROWS), OFFSET_ROWS)
    lo = tl.maximum(-off, 0)
    size = tl.maximum(tl.load(size_ptr), 0)
    hi = tl.minimum(tl.minimum(size, PLAIN_ROWS), OFFSET_ROWS - off)
    hi = tl.maximum(hi, lo)
    off = tl.multiple_of(off.to(tl.int64) * ROW_ELEMS, ALIGN)
    lo = tl.multiple_of(lo.to(tl.int64) * ROW_ELEMS, ALIGN)
    hi = tl.multiple_of(hi.to(tl.int64) * ROW_ELEMS, ALIGN)
    return off, lo, hi


@triton.jit
def _load(ptrs, mask, EVICT: tl.constexpr):
    if EVICT == 1:
        vals = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    elif EVICT == 2:
        vals = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_last")
    else:
        vals = tl.load(ptrs, mask=mask, other=0)
    return vals


@triton.jit
def dp_memcpy_kernel(
    offset_ptr,  # [1] int32: row offset
    size_ptr,  # [1] int32: rows asked for
    src_ptr,  # [src_rows * ROW_ELEMS]
    dst_in_ptr,  # [dst_rows * ROW_ELEMS], aliased to dst_ptr
    dst_ptr,  # [dst_rows * ROW_ELEMS]
    PLAIN_ROWS: tl.constexpr,
    OFFSET_ROWS: tl.constexpr,
    ROW_ELEMS: tl.constexpr,
    OFFSET_SRC: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    EVICT: tl.constexpr,
):
    off, lo, hi = _window(offset_ptr, size_ptr, PLAIN_ROWS, OFFSET_ROWS, ROW_ELEMS, ALIGN)
    count = hi - lo
    first = tl.program_id(0).to(tl.int64) * BLOCK
    if first < count:
        lanes = first + tl.arange(0, BLOCK)
        mask = lanes < count
        if OFFSET_SRC:
            vals = _load(src_ptr + (off + lo) + lanes, mask, EVICT)
            tl.store(dst_ptr + lo + lanes, vals, mask=mask)
        else:
            vals = _load(src_ptr + lo + lanes, mask, EVICT)
            tl.store(dst_ptr + (off + lo) + lanes, vals, mask=mask)


@triton.jit
def slice_pad_kernel(
    start_ptr,  # [1] int32: first row of x
    length_ptr,  # [1] int32: rows asked for
    x_ptr,  # [x_rows * ROW_ELEMS]
    out_ptr,  # [PLAIN_ROWS * ROW_ELEMS]
    PLAIN_ROWS: tl.constexpr,
    OFFSET_ROWS: tl.constexpr,
    ROW_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    EVICT: tl.constexpr,
):
    off, lo, hi = _window(start_ptr, length_ptr, PLAIN_ROWS, OFFSET_ROWS, ROW_ELEMS, ALIGN)
    elem = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (elem >= lo) & (elem < hi)
    vals = _load(x_ptr + off + elem, mask, EVICT)
    tl.store(out_ptr + elem, vals, mask=elem < PLAIN_ROWS * ROW_ELEMS)


@triton.jit
def merge_pair_kernel(
    start_a_ptr,  # [1] int32: output row of part a's row 0
    length_a_ptr,  # [1] int32: rows of part a asked for
    start_b_ptr,  # [1] int32
    length_b_ptr,  # [1] int32
    a_ptr,  # [A_ROWS * ROW_ELEMS]
    b_ptr,  # [B_ROWS * ROW_ELEMS]
    base_ptr,  # [OUT_ROWS * ROW_ELEMS]: earlier parts' merge (aliased to out_ptr) if HAS_BASE
    out_ptr,  # [OUT_ROWS * ROW_ELEMS]
    A_ROWS: tl.constexpr,
    B_ROWS: tl.constexpr,
    OUT_ROWS: tl.constexpr,
    ROW_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    HAS_BASE: tl.constexpr,
    EVICT: tl.constexpr,
):
    elem = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_out = elem < OUT_ROWS * ROW_ELEMS
    if HAS_BASE:
        acc = tl.load(base_ptr + elem, mask=in_out)
    else:
        acc = tl.zeros((BLOCK,), out_ptr.dtype.element_ty)
    off, lo, hi = _window(start_a_ptr, length_a_ptr, A_ROWS, OUT_ROWS, ROW_ELEMS, ALIGN)
    mask = (elem >= off + lo) & (elem < off + hi)
    acc = tl.where(mask, _load(a_ptr + (elem - off), mask, EVICT), acc)
    off, lo, hi = _window(start_b_ptr, length_b_ptr, B_ROWS, OUT_ROWS, ROW_ELEMS, ALIGN)
    mask = (elem >= off + lo) & (elem < off + hi)
    acc = tl.where(mask, _load(b_ptr + (elem - off), mask, EVICT), acc)
    tl.store(out_ptr + elem, acc, mask=in_out)
