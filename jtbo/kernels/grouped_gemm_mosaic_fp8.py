"""Hopper kernels of the grouped expert FFN with FP8 weights and FP8 activations (Pallas
Mosaic GPU: TMA loads, FP8 ``wgmma``).

The ``"mosaic"`` impl of ``grouped_gemm.grouped_ffn`` for block-scaled FP8 weights
(``fp8_blocks.BlockQuantized``, stored contraction-last) with ``fp8_activations``: the scheme
of ``grouped_gemm``'s module docstring, on the tile-major rows and the persistent 2-CTA
cluster grid of ``grouped_gemm_mosaic``.

Data flow: the rows are quantized per ``qk`` columns (``fp8_blocks.quantize_rows`` in
``(1, qk)`` blocks) and gathered into the live tiles' tile-major order (``tile_gather``):
the source rows quantized first where they are fewer than the tiles' rows (the FP8 values
then travel as bytes), else the tiles' rows gathered first (``gathered_fp8_rows``). The
gate / up kernel writes FP8 hidden rows and one scale per row and ``qk`` columns; the down
kernel reads them and writes the output rows in the tokens' dtype. Row scales are kept
transposed, ``[K / qk, rows]``, so that one pipeline step loads the scales of its contraction
block for a whole row tile in one TMA copy.

Per contraction step (``tile_k = qk``, one weight block deep): each compute warpgroup runs an
FP8 x FP8 ``wgmma`` of its ``tile_m`` rows against the ``[tile_n, qk]`` weight tile into a
fresh float32 accumulator (``wgmma`` takes FP8 operands K-major only, the stored order), then
adds it to the running sum scaled by its rows' scales times the block's scale, read from the
weight scales in global memory (DeepSeek-V3's promotion of each block's partial sums). The
gate and the up products are promoted one after the other, so that a warpgroup holds two
running sums and one partial sum in registers; the other compute warpgroup's ``wgmma`` runs
while one promotes. ``tile_n`` is the block's width, so one scale covers a tile (with
``split_columns`` the two warpgroups take neighbouring blocks of a ``2 * tile_n``-column tile
over the same ``tile_m`` rows, each with its block's scale). The gate / up
epilogue computes ``silu(gate) * up`` and quantizes each row of the tile (one group: ``tile_n``
is the down weight's contraction block) as ``fp8_blocks`` does: its largest magnitude times
``1 / 448`` (1 for a zero row), the values divided by it (within 2 ulps, the kernels'
``approx_math``: as the Pallas kernels divide on the GPU).

Padding rows inside a live tile are zero bytes (FP8 zero) with scale zero, so they produce
zero hidden rows (scale 1) and zero outputs; dead tiles are skipped, their rows never read.
With ``prefetch_across_tiles`` a CTA's live tiles form one pipeline, as in
``grouped_gemm_mosaic``: the memory warpgroup loads the next tile's first blocks while the
compute warpgroups promote the current tile's last ones and store it.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jtbo.kernels import (
    fp8_blocks,
    gemm_config,
    grouped_gemm_mosaic,
    impls,
    slot_rows,
    tile_gather,
    tile_table,
)

_F32 = jnp.float32
_WARPGROUP = grouped_gemm_mosaic.WARPGROUP


def _block_product(a_smem, b_smem, shape: tuple[int, int]) -> jax.Array:
    """``a_smem [tile_m, qk] @ b_smem [tile_n, qk].T`` in float32, a fresh accumulator."""

    def dot(acc_ref):
        with jax.named_scope(grouped_gemm_mosaic.SCOPE_WGMMA_ISSUE):
            plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
        with jax.named_scope(grouped_gemm_mosaic.SCOPE_WGMMA_WAIT):
            return acc_ref[...]

    return pl.run_scoped(dot, plgpu.ACC(shape, _F32))


@jax.named_scope(grouped_gemm_mosaic.SCOPE_SCALES)
def _row_scales(scale_smem) -> jax.Array:
    """A warpgroup's rows' scales of one contraction step, ``scale_smem [tile_m]``, loaded in
    the accumulators' layout along their rows."""
    return plgpu.load(scale_smem, layout=plgpu.Layout.WGMMA.reduce(1))


@jax.named_scope(grouped_gemm_mosaic.SCOPE_PROMOTE)
def _promoted(running: jax.Array, part: jax.Array, factor: jax.Array):
    """``running + part * factor``: one block's product ``part [tile_m, tile_n]`` promoted
    into the running sum, ``factor [tile_m]`` (its rows' scales times the block's) along its
    rows."""
    return running + part * lax.broadcast_in_dim(factor, part.shape, [0])


def _quantized_rows(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(values / scale as FP8, scale [tile_m])`` of an accumulator ``values [tile_m,
    tile_n]``, one scale per row: its largest magnitude over the row (``fp8_blocks``)."""
    amax = jnp.max(jnp.abs(values), axis=1)
    scale = jnp.where(amax > 0, amax * fp8_blocks.INV_FP8_MAX, jnp.ones_like(amax))
    quotient = values / lax.broadcast_in_dim(scale, values.shape, [0])
    return quotient.astype(fp8_blocks.FP8_DTYPE), scale


def _fp8_matmul_body(tile_expert_gmem, *refs, column_offsets, cfg, num_col_tiles):
    # tile_expert_gmem: [num_tiles] int32 expert per row tile (-1: dead); refs: first the
    # optional tile operands (grouped_gemm_mosaic.tile_refs), then a_gmem, a_scale_gmem,
    # b_gmem, b_scale_gmem and the outputs. a_gmem: [R, K] FP8
    # tile-major rows (R = num_tiles * block_m); a_scale_gmem: [K / qk, R] float32;
    # b_gmem: [E, N_b, K] FP8; b_scale_gmem: [E, N_b / tile_n, K / qk] float32. out_gmems:
    # (out [R, N],) in the output dtype, or with two accumulators (gate, up) (hidden [R, N]
    # FP8, hidden scales [N / tile_n, R] float32). Accumulator i reads the weight rows
    # column_offsets[i] + (column tile) * block_n.
    num_live_gmem = grouped_gemm_mosaic.tile_refs(cfg, refs)
    # As many outputs as accumulators: the down kernel's rows; the gate / up kernel's hidden
    # rows and their scales.
    num_acc = len(column_offsets)
    a_gmem, a_scale_gmem, b_gmem, b_scale_gmem = refs[-4 - num_acc : -num_acc]
    out_gmems = refs[-num_acc:]
    block_m, block_n, tile_m, tile_n = cfg.block_m, cfg.block_n, cfg.tile_m, cfg.tile_n
    tile_k = cfg.tile_k
    k_steps = a_gmem.shape[1] // tile_k
    operand_transforms = grouped_gemm_mosaic.smem_transforms(tile_k, 1)

    def pipeline(body, compute_context, pipeline_state=None):
        a_spec = plgpu.BlockSpec(
            (block_m, tile_k), lambda k: (0, k), transforms=operand_transforms,
            memory_space=plgpu.SMEM,
            collective_axes=grouped_gemm_mosaic.row_collective_axes(num_col_tiles),
        )  # fmt: skip
        scale_spec = plgpu.BlockSpec((None, block_m), lambda k: (k, 0), memory_space=plgpu.SMEM)
        b_spec = plgpu.BlockSpec(
            (block_n, tile_k), lambda k: (0, k), transforms=operand_transforms,
            memory_space=plgpu.SMEM,
        )  # fmt: skip
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=cfg.memory_registers,
            in_specs=[a_spec, scale_spec] + [b_spec] * num_acc, wg_axis=_WARPGROUP,
            num_compute_wgs=2, max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context, pipeline_state=pipeline_state,
        )  # fmt: skip

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    allocations = pipeline(ignore, ignore).get_allocations(
        a_gmem, a_scale_gmem, *[b_gmem.at[0]] * num_acc
    )
    smem = {"out_smem": grouped_gemm_mosaic.epilogue_smem(out_gmems[0].dtype)}
    if num_acc == 2:  # (warpgroup, rows): the hidden rows' scales
        smem["scale_smem"] = plgpu.SMEM((2, tile_m), _F32)

    @functools.partial(pl.run_scoped, allocations=allocations, **smem, collective_axes=_WARPGROUP)
    def _scope(allocations, out_smem, scale_smem=None):
        warpgroup = lax.axis_index(_WARPGROUP)

        def visit(tile, col, pipeline_state=None):
            expert = tile_expert_gmem[tile]
            rows = pl.ds(tile * block_m, block_m)
            wg_rows, wg_cols = grouped_gemm_mosaic.warpgroup_part(cfg, warpgroup)
            row_start, block = _warpgroup_origin(cfg, warpgroup, col)
            # Each accumulator's weight-scale row: the warpgroup's tile_n-wide block.
            scale_rows = [offset // tile_n + block for offset in column_offsets]

            def compute_context(run_pipeline):
                zeros = jnp.full((tile_m, tile_n), 0, _F32)
                sums = run_pipeline((plgpu.layout_cast(zeros, plgpu.Layout.WGMMA),) * num_acc)
                out_tile = out_gmems[0].at[rows, pl.ds(col * block_n, block_n)]
                wg_out = out_tile.at[wg_rows, wg_cols]
                out_rows = pl.ds(tile * block_m + row_start, tile_m)
                wg_scales = out_gmems[1].at[block, out_rows] if num_acc == 2 else None
                with jax.named_scope(grouped_gemm_mosaic.SCOPE_EPILOGUE):
                    _epilogue(sums, out_smem, scale_smem, warpgroup, wg_out, wg_scales)

            def mma(indices, a_smem, a_scale_smem, *rest):
                b_smems, sums = rest[:num_acc], rest[num_acc]
                step = indices[0]
                # The scales are loaded before the first wgmma is issued, so that their
                # latency (a global load each) runs under the tensor cores' work.
                row_scale = _row_scales(a_scale_smem.at[wg_rows])
                factors = [row_scale * b_scale_gmem[expert, row, step] for row in scale_rows]
                promoted = []
                for b_smem, running, factor in zip(b_smems, sums, factors, strict=True):
                    part = _block_product(a_smem.at[wg_rows], b_smem.at[wg_cols], (tile_m, tile_n))
                    promoted.append(_promoted(running, part, factor))
                return tuple(promoted)

            weights = [
                b_gmem.at[expert, pl.ds(offset + col * block_n, block_n), :]
                for offset in column_offsets
            ]
            run = functools.partial(
                pipeline(mma, compute_context, pipeline_state), a_gmem.at[rows, :],
                a_scale_gmem.at[:, rows], *weights, allocations=allocations,
            )  # fmt: skip
            grouped_gemm_mosaic.run_unless_dead(run, expert, pipeline_state)

        grouped_gemm_mosaic.walk(
            cfg, k_steps, tile_expert_gmem.shape[0], num_col_tiles, num_live_gmem, visit
        )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _warpgroup_origin(cfg: gemm_config.MosaicGemmConfig, warpgroup, col):
    """``(first row in the row tile, column block)`` of compute warpgroup ``warpgroup``'s
    ``tile_m x tile_n`` part of column tile ``col``: the column block indexes the weight
    scales' and the hidden scales' ``tile_n``-wide blocks (from the accumulator's offset)."""
    if cfg.split_columns:
        return 0, col * 2 + warpgroup
    return warpgroup * cfg.tile_m, col


def _epilogue(sums, out_smem, scale_smem, warpgroup, wg_out, wg_scales):
    """Writes one warpgroup's part ``wg_out`` of a tile: the down kernel's sum in the output
    dtype, or the gate / up kernel's ``silu(gate) * up`` quantized per token (the rows of
    ``wg_out``), with their scales to ``wg_scales``."""
    if len(sums) == 1:
        grouped_gemm_mosaic.store_tile(sums[0].astype(wg_out.dtype), out_smem, wg_out, warpgroup)
        return
    gate, up = sums
    values, scale = _quantized_rows(grouped_gemm_mosaic.swiglu(gate, up))
    # store_tile first waits for every earlier store, the last tile's scales included.
    grouped_gemm_mosaic.store_tile(values, out_smem, wg_out, warpgroup)
    scale_smem.at[warpgroup][...] = scale
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(scale_smem.at[warpgroup], wg_scales)


def _tile_problem(cfg: gemm_config.MosaicGemmConfig, out_cols: int, contraction: int,
                  quant_block: tuple[int, int]) -> str | None:  # fmt: skip
    """Why one kernel cannot tile its shapes (None when it can): a contraction step must be
    one weight block deep, a column tile one block wide, no step's ``wgmma`` left in flight
    (each block's product is read to scale it), and the clusters' column pairs and the steps
    must cover the shapes. (Prefetching across tiles also needs steps that the stages divide:
    ``grouped_gemm_mosaic.walk`` raises.)"""
    qk, qn = quant_block
    if cfg.tile_k != qk or cfg.tile_n != qn:
        return (
            f"impl='mosaic' with FP8 weights steps one {qk} x {qn} weight block at a time: "
            f"tile_k {cfg.tile_k} and tile_n {cfg.tile_n} must be {qk} and {qn} "
            "(gemm_config.MOSAIC_FFN_FP8)"
        )
    if cfg.wgmma_in_flight:
        return (
            "impl='mosaic' with FP8 weights reads each block's product to scale it: "
            f"wgmma_in_flight must be 0, got {cfg.wgmma_in_flight} (gemm_config.MOSAIC_FFN_FP8)"
        )
    if out_cols % cfg.block_n or contraction % cfg.tile_k:
        return (
            f"impl='mosaic' tiles {out_cols} columns by {cfg.block_n} and the contraction "
            f"{contraction} by {cfg.tile_k}; use impl='pallas'"
        )
    return None


def _ffn_problem(hidden: int, ffn: int, gate_up_block, down_block, cfg) -> str | None:
    """Why the two kernels cannot tile an FFN (None when they can)."""
    problem = _tile_problem(cfg.gate_up, ffn, hidden, gate_up_block)
    problem = problem or _tile_problem(cfg.down, hidden, ffn, down_block)
    if problem is None and cfg.gate_up.tile_n != down_block[0]:
        problem = (
            f"FP8 hidden rows are quantized per gate / up column tile ({cfg.gate_up.tile_n}), "
            f"which must be the down weight's contraction block ({down_block[0]})"
        )
    return problem


def tiles(hidden: int, ffn: int, quant_block: tuple[int, int], cfg) -> bool:
    """Whether the kernels with launch shapes ``cfg`` (a ``MosaicFfnConfig``) tile an FFN of
    ``hidden`` and ``ffn`` whose weights are FP8 in ``quant_block = (qk, qn)`` blocks."""
    return _ffn_problem(hidden, ffn, quant_block, quant_block, cfg) is None


def _fp8_matmul(tile_expert, a_rows, a_scales, weight, *, out_cols, column_offsets, out_dtype,
                cfg, interpret):  # fmt: skip
    """One FP8 grouped GEMM over tile-major rows: ``([R, out_cols] in out_dtype,)``, or with
    two column offsets (gate / up) the FP8 hidden rows and their ``[out_cols / tile_n, R]``
    scales."""
    values, scales = weight
    body = functools.partial(
        _fp8_matmul_body, column_offsets=column_offsets, cfg=cfg,
        num_col_tiles=out_cols // cfg.block_n,
    )  # fmt: skip
    num_rows = a_rows.shape[0]
    out_type = [jax.ShapeDtypeStruct((num_rows, out_cols), out_dtype)]
    if len(column_offsets) == 2:
        out_type.append(jax.ShapeDtypeStruct((out_cols // cfg.tile_n, num_rows), _F32))
    kernel = grouped_gemm_mosaic.persistent_kernel(body, tuple(out_type), interpret)
    tile_operands = grouped_gemm_mosaic.tile_operands(tile_expert, cfg)
    return kernel(*tile_operands, a_rows, a_scales, values, scales)


def gathered_fp8_rows(x_slots, slot_of_row, tile_expert, block_m: int, qk: int):
    """The live tiles' rows quantized per ``qk`` columns: ``(values [R, H] FP8, scales
    [H / qk, R] float32)``, zero bytes and zero scales for padding rows.

    Each row is quantized on its own, so quantizing the source rows then gathering them gives
    the bits of gathering then quantizing: whichever side has fewer rows is quantized. The
    one-device layer's ``SlotRows`` hold a row per token, fewer than the tiles' rows; a slot
    buffer holds every capacity slot, and an EP dispatch's ``SlotRows`` a buffer per peer,
    which can be more."""
    source_rows, source = slot_rows.flat_slot_source(x_slots, slot_of_row)
    source = grouped_gemm_mosaic.unfused(source)
    if source_rows.shape[0] > source.shape[0]:
        gathered = tile_gather.gather_tiles(source_rows, source, tile_expert, block_m)
        quantized = fp8_blocks.quantize_rows(gathered, qk)
        # A padding row is zero, so its scale is 1 (fp8_blocks); the contract says zero.
        scales = jnp.where(source[:, None] >= 0, quantized.scales, 0.0)
        return quantized.values, scales.T
    quantized = fp8_blocks.quantize_rows(source_rows, qk)
    as_bytes = lax.bitcast_convert_type(quantized.values, jnp.uint8)  # FP8 has no fill value
    values = tile_gather.gather_tiles(as_bytes, source, tile_expert, block_m)
    scales = tile_gather.gather_tiles(quantized.scales, source, tile_expert, block_m)
    return lax.bitcast_convert_type(values, fp8_blocks.FP8_DTYPE), scales.T


def grouped_ffn_mosaic_fp8(x_slots, counts, w_gate_up, w_down, *, max_rows, cfg, interpret):
    """The Mosaic GPU impl with FP8 weights and activations: ``SlotRows`` of the outputs.

    ``x_slots`` a slot buffer ``[E, C, H]`` or ``SlotRows``; ``counts`` clipped to ``[0, C]``;
    ``w_gate_up`` / ``w_down`` ``BlockQuantized`` stored contraction-last in ``(qk, qn)``
    blocks, ``cfg`` a ``MosaicFfnConfig`` whose steps and column tiles are those blocks.
    """
    num_experts, capacity, hidden = x_slots.shape
    ffn = w_gate_up.shape[3]
    gate_up_block = (w_gate_up.block_shape[1], w_gate_up.block_shape[3])
    down_block = (w_down.block_shape[1], w_down.block_shape[2])
    problem = _ffn_problem(hidden, ffn, gate_up_block, down_block, cfg)
    if problem is not None:
        raise impls.KernelUnavailableError(problem)
    block_m = cfg.gate_up.block_m
    num_tiles = tile_table.max_tiles(num_experts, capacity, block_m, max_rows)
    tiles = grouped_gemm_mosaic.tile_rows(counts, capacity, block_m, num_tiles)
    tile_expert, slot_of_row, row_of_slot = tiles
    rows, row_scales = gathered_fp8_rows(
        x_slots, slot_of_row, tile_expert, block_m, gate_up_block[0]
    )
    gate_up_matrices = fp8_blocks.expert_matrices(w_gate_up, 2 * ffn, hidden, "mosaic")
    down_matrices = fp8_blocks.expert_matrices(w_down, hidden, ffn, "mosaic")
    hidden_rows, hidden_scales = _fp8_matmul(
        tile_expert, rows, row_scales, gate_up_matrices,
        out_cols=ffn, column_offsets=(0, ffn), out_dtype=fp8_blocks.FP8_DTYPE,
        cfg=cfg.gate_up, interpret=interpret,
    )  # fmt: skip
    (out_rows,) = _fp8_matmul(
        tile_expert, hidden_rows, hidden_scales, down_matrices,
        out_cols=hidden, column_offsets=(0,), out_dtype=x_slots.dtype, cfg=cfg.down,
        interpret=interpret,
    )  # fmt: skip
    return slot_rows.SlotRows(out_rows, row_of_slot)
