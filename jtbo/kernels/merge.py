"""TBO output merge: each part's first rows written at its offset in a zero buffer.

SGLang ``_model_forward_tbo_merge_outputs``: ``out[starts[k] + j] = parts[k][j]`` for
``0 <= j < lengths[k]`` where both rows exist; rows no part covers are zero; where
parts overlap, the later part wins. Out-of-range rows follow ``jtbo.kernels.ranges``
(plain side = the part, offset side = ``out``).

Kernel: one pass over the output. Each program owns one block of output elements;
for each part it loads the matching elements under that part's mask (masked lanes
read nothing) and selects them over what earlier parts gave, then stores the whole
block once: bytes moved = (sum of lengths + out_len) * row bytes. Part loads use a
gathered index vector since a block's start in a part may be negative. Each
program derives every part's window from the raw ``starts`` / ``lengths``
(``ranges.window_bounds``), so a call is a single launch. The Triton kernel takes
parts two at a time (TBO has two); further pairs are merged into the aliased result
of the previous launch.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.kernels import copy_config, impls, ranges


def _merge_kernel(*refs, part_rows, out_len, row_elems, block, align, evict):
    # refs: start_k [1] int32, length_k [1] int32 for each part k; then part_k
    # [part_rows_k * row_elems] for each part; then out [out_len * row_elems].
    num_parts = len(part_rows)
    scalar_refs, part_refs, out_ref = refs[: 2 * num_parts], refs[2 * num_parts : -1], refs[-1]
    first = pl.program_id(0) * block
    elem = first + jnp.arange(block, dtype=jnp.int32)
    acc = jnp.zeros((block,), out_ref.dtype)
    for k, part_ref in enumerate(part_refs):
        start, length = scalar_refs[2 * k][0], scalar_refs[2 * k + 1][0]
        off, lo, hi = ranges.window_bounds(start, length, part_rows[k], out_len)
        shift = pl.multiple_of(off * row_elems, align)
        lo_elem = pl.multiple_of(lo * row_elems, align) + shift
        hi_elem = pl.multiple_of(hi * row_elems, align) + shift
        mask = (elem >= lo_elem) & (elem < hi_elem)
        zero = jnp.zeros((), acc.dtype)
        vals = plgpu.load(part_ref.at[elem - shift], mask=mask, other=zero, eviction_policy=evict)
        acc = jnp.where(mask, vals, acc)
    plgpu.store(out_ref.at[pl.ds(first, block)], acc, mask=elem < out_len * row_elems)


def _launch_shape(parts, out_len, cfg):
    """(row elems, block, grid, align) of one launch."""
    cols = ranges.row_elems(parts[0].shape)
    align = cfg.align(cols, parts[0].dtype.itemsize)
    block = cfg.block_for(out_len * cols, parts[0].dtype.itemsize)
    return cols, block, pl.cdiv(out_len * cols, block), align


def _flat_scalars(starts, lengths):
    """``[start_0, length_0, start_1, ...]`` as ``[1]`` int32 arrays (free reshapes)."""
    return [v.reshape(1) for pair in zip(starts, lengths, strict=True) for v in pair]


def merge_rows_pallas(parts, starts, lengths, *, out_len, cfg, interpret):
    """Pallas impl on per-part int32 scalars; returns ``[out_len, ...]``."""
    cols, block, grid, align = _launch_shape(parts, out_len, cfg)
    impls.check_pallas_elems([p.size for p in parts] + [out_len * cols], block)
    kernel = functools.partial(
        _merge_kernel, part_rows=tuple(p.shape[0] for p in parts), out_len=out_len,
        row_elems=cols, block=block, align=align, evict=cfg.eviction_policy,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((out_len * cols,), parts[0].dtype),
        grid=(grid,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(*_flat_scalars(starts, lengths), *(p.reshape(-1) for p in parts))
    return out.reshape((out_len, *parts[0].shape[1:]))


def _triton_pair(base, parts, scalars, *, cols, out_len, block, grid, align, cfg):
    from jtbo.kernels import triton_kernels  # imports triton: GPU machines only

    has_base = base is not None
    part_a, part_b = parts
    # Without a base the kernel never reads its base pointer; part_a stands in.
    base = base if has_base else part_a.reshape(-1)
    return impls.jax_triton().triton_call(
        *scalars,
        part_a.reshape(-1),
        part_b.reshape(-1),
        base,
        kernel=triton_kernels.merge_pair_kernel,
        out_shape=jax.ShapeDtypeStruct((out_len * cols,), part_a.dtype),
        grid=(grid,),
        input_output_aliases={6: 0} if has_base else {},  # earlier pairs' result, in place
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        A_ROWS=part_a.shape[0],
        B_ROWS=part_b.shape[0],
        OUT_ROWS=out_len,
        ROW_ELEMS=cols,
        BLOCK=block,
        ALIGN=align,
        HAS_BASE=has_base,
        EVICT=triton_kernels.eviction(cfg.eviction_policy),
    )


def merge_rows_triton(parts, starts, lengths, *, out_len, cfg):
    """jax-triton impl on per-part int32 scalars; returns ``[out_len, ...]``."""
    cols, block, grid, align = _launch_shape(parts, out_len, cfg)
    scalars = _flat_scalars(starts, lengths)
    if len(parts) % 2:  # pad with an empty part (length 0) so parts go in pairs
        parts = (*parts, parts[-1])
        scalars += [scalars[0], jnp.zeros((1,), jnp.int32)]
    out = None
    for k in range(0, len(parts), 2):
        out = _triton_pair(
            out, parts[k : k + 2], scalars[2 * k : 2 * k + 4],
            cols=cols, out_len=out_len, block=block, grid=grid, align=align, cfg=cfg,
        )  # fmt: skip
    return out.reshape((out_len, *parts[0].shape[1:]))


def merge_rows_reference(parts, windows, *, out_len):
    """Plain-jnp impl (``impl="xla"``): per part a row gather and a select, later parts last."""
    # windows: one int32 [3] (offset, lo, hi) per part (ranges.copy_window).
    out = jnp.zeros((out_len, *parts[0].shape[1:]), parts[0].dtype)
    r = jnp.arange(out_len, dtype=jnp.int32)
    for part, (off, lo, hi) in zip(parts, windows, strict=True):
        j = r - off
        valid = (j >= lo) & (j < hi)
        rows = jnp.take(part, jnp.where(valid, j, 0), axis=0)
        out = jnp.where(valid.reshape((out_len,) + (1,) * (out.ndim - 1)), rows, out)
    return out


def _scalars(values, count, name):
    if isinstance(values, jax.Array | jnp.ndarray) and values.ndim == 1:
        values = list(values)
    if len(values) != count:
        raise ValueError(f"{name} needs one entry per part ({count}), got {len(values)}")
    return [ranges.as_row_scalar(v, f"{name}[{k}]") for k, v in enumerate(values)]


def merge_rows(parts, starts, lengths, *, out_len, impl=None, config=None):
    """Writes each part's first ``lengths[k]`` rows at row ``starts[k]`` of a zero buffer.

    Args:
      parts: non-empty sequence of ``[part_rows_k, ...]`` arrays sharing trailing shape
        and dtype (row counts may differ).
      starts: one int32 scalar per part (a sequence, or an int array ``[num_parts]``).
      lengths: one int32 scalar per part, likewise.
      out_len: static row count of the result.
      impl: ``"xla"``, ``"pallas"``, ``"triton"`` or None (fastest available).
      config: ``CopyConfig`` for the kernels; None for the tuned default.

    Returns:
      ``[out_len, ...]`` array; rows no part covers are zero; later parts win overlaps.

    Raises:
      ValueError: no parts, mismatched parts, bad ``out_len``, scalars or impl name.
      KernelUnavailableError: the named impl cannot run on this backend.
    """
    parts = tuple(parts)
    if not parts:
        raise ValueError("merge_rows needs at least one part, got 0")
    for k, part in enumerate(parts):
        ranges.check_pair(parts[0], part, "parts[0]", f"parts[{k}]")
    out_len = ranges.check_static_rows(out_len, "out_len")
    impl = impls.resolve(impl, op="merge_rows")
    starts = _scalars(starts, len(parts), "starts")
    lengths = _scalars(lengths, len(parts), "lengths")
    cfg = config or copy_config.MERGE_ROWS
    out_shape = (out_len, *parts[0].shape[1:])
    # Empty parts copy nothing, and the kernels need real buffers: leave them out.
    kept = [k for k, part in enumerate(parts) if part.size]
    if not kept or out_len * ranges.row_elems(out_shape) == 0:
        return jnp.zeros(out_shape, parts[0].dtype)
    parts = tuple(parts[k] for k in kept)
    starts, lengths = [starts[k] for k in kept], [lengths[k] for k in kept]
    if impl == "pallas":
        interpret = impls.backend() == "cpu"
        return merge_rows_pallas(
            parts, starts, lengths, out_len=out_len, cfg=cfg, interpret=interpret
        )
    if impl == "triton":
        return merge_rows_triton(parts, starts, lengths, out_len=out_len, cfg=cfg)
    windows = [
        ranges.copy_window(s, n, p.shape[0], out_len)
        for p, s, n in zip(parts, starts, lengths, strict=True)
    ]
    return merge_rows_reference(parts, windows, out_len=out_len)
