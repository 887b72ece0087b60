"""Hopper kernels of the grouped expert FFN (Pallas Mosaic GPU: TMA loads, ``wgmma``).

The ``"mosaic"`` impl of ``grouped_gemm.grouped_ffn``. Where the ``"pallas"`` kernels (Triton
lowering) load rows with per-row pointers, these copy whole tiles with the Tensor Memory
Accelerator (TMA), and a 2-CTA cluster loads a row tile once for both of its CTAs (TMA
multicast), which halves the L2 traffic of the rows that every column tile reads again.

Layout (*tile-major rows*): the rows are first gathered (``tile_gather``: the live tiles' rows
only) into a ``[num_tiles * block_m, H]`` buffer in which row tile ``t`` is rows
``[t * block_m, (t + 1) * block_m)``, all of one expert (``tile_expert[t]``, -1 for a tile
past the live ones); an expert's rows past its count in its last tile are zero. Every tile
then starts at a multiple of ``block_m``, as a TMA block index needs, whatever the capacity,
and the padding rows need no mask: zero rows give zero hidden rows (``silu(0) * 0``) and
zero outputs. ``tile_rows`` builds the layout from the counts.

Kernel (one per GEMM, ``_grouped_matmul``): persistent, one 2-CTA cluster per pair of SMs,
walking the (row tile, column tile) pairs with ``plgpu.nd_loop``. Each CTA has two compute
warpgroups of ``tile_m`` rows each (``block_m = 2 * tile_m``) and one memory warpgroup that
runs the TMA pipeline over the contraction (``emit_pipeline_warp_specialized``); with
``wgmma_in_flight`` a compute warpgroup issues a step's ``wgmma`` before the previous step's
has finished, and the pipeline releases a stage's buffers one step later. The two CTAs
of a cluster take neighbouring column tiles of the same row tile: the row tile is loaded
once for both (``collective_axes``), the weight columns per CTA. With an odd number of
column tiles the last pair's second CTA computes the last tile again and does not store it.
A dead tile (expert -1) is skipped. The gate / up kernel keeps a gate and an up accumulator
and writes ``silu(gate) * up`` in the input dtype; the down kernel writes its accumulator.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jtbo.core import arith
from jtbo.kernels import gemm_config, impls, slot_rows, tile_gather, tile_table

_F32 = jnp.float32
CLUSTER = "cluster"  # the 2 CTAs of a cluster
CLUSTER_GRID = "cluster_grid"  # the clusters of the persistent grid
WARPGROUP = "wg"  # the 2 compute warpgroups and the memory warpgroup of a CTA
EPILOGUE_TILE = gemm_config.MOSAIC_EPILOGUE_TILE


def smem_transforms(minor_elems: int, itemsize: int) -> tuple:
    """Shared-memory tiling and swizzle of a tile whose minor dimension is ``minor_elems``."""
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _grouped_matmul_body(tile_expert_gmem, *refs, column_offsets, epilogue, cfg, num_col_tiles):
    # tile_expert_gmem: [num_tiles] int32 expert of each row tile (-1: dead); refs: with
    # cfg.skip_empty_warpgroups first tile_live_rows_gmem, [num_tiles] int32 rows of each tile
    # that hold a slot; then a_gmem: [num_tiles * block_m, K] tile-major rows; b_gmem:
    # [E, K, N_b] weights; out_gmem: [num_tiles * block_m, N] with N = num_col_tiles * tile_n.
    # Accumulator i reads the weight columns column_offsets[i] + (column tile) * tile_n.
    a_gmem, b_gmem, out_gmem = refs[-3:]
    tile_live_rows_gmem = refs[0] if cfg.skip_empty_warpgroups else None
    block_m, tile_m, tile_n, tile_k = cfg.block_m, cfg.tile_m, cfg.tile_n, cfg.tile_k
    num_tiles = tile_expert_gmem.shape[0]
    k_steps = a_gmem.shape[1] // tile_k
    itemsize = jnp.dtype(a_gmem.dtype).itemsize
    operand_transforms = smem_transforms(tile_k, itemsize)
    weight_transforms = smem_transforms(tile_n, itemsize)
    num_acc = len(column_offsets)

    def pipeline(body, compute_context):
        a_spec = plgpu.BlockSpec(
            (block_m, tile_k), lambda k: (0, k), transforms=operand_transforms,
            memory_space=plgpu.SMEM, collective_axes=(CLUSTER,),
            delay_release=cfg.wgmma_in_flight,
        )  # fmt: skip
        b_spec = plgpu.BlockSpec(
            (tile_k, tile_n), lambda k: (k, 0), transforms=weight_transforms,
            memory_space=plgpu.SMEM, delay_release=cfg.wgmma_in_flight,
        )  # fmt: skip
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=40, in_specs=[a_spec] + [b_spec] * num_acc,
            wg_axis=WARPGROUP, num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps, compute_context=compute_context,
        )  # fmt: skip

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)
    out_transforms = smem_transforms(EPILOGUE_TILE, jnp.dtype(out_gmem.dtype).itemsize)
    epi_shape = (2, 2, EPILOGUE_TILE, EPILOGUE_TILE)  # (warpgroup, buffer, rows, columns)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(a_gmem, *[b_gmem.at[0]] * num_acc),
        out_smem=plgpu.SMEM(epi_shape, out_gmem.dtype, transforms=out_transforms),
        collective_axes=WARPGROUP,
    )
    def _scope(allocations, out_smem):
        warpgroup = lax.axis_index(WARPGROUP)

        @functools.partial(walk_tiles, num_tiles, num_col_tiles, cfg.grid_tile_width)
        def _visit(tile, col, stores):
            expert = tile_expert_gmem[tile]
            rows = pl.ds(tile * block_m, block_m)
            wg_rows = pl.ds(warpgroup * tile_m, tile_m)
            if tile_live_rows_gmem is not None:
                wg_has_rows = tile_live_rows_gmem[tile] > warpgroup * tile_m

            def compute_context(run_pipeline):
                @functools.partial(
                    pl.run_scoped, accs=[plgpu.ACC((tile_m, tile_n), _F32)] * num_acc
                )
                def _acc_scope(accs):
                    run_pipeline(tuple(accs))
                    out = epilogue(*[acc[...] for acc in accs]).astype(out_gmem.dtype)
                    out_tile = out_gmem.at[rows, pl.ds(col * tile_n, tile_n)]
                    when_stored(stores, lambda: store_tile(
                        out, out_smem, out_tile, warpgroup, tile_m, tile_n
                    ))  # fmt: skip

            def mma(_, a_smem, *rest):
                b_smems, accs = rest[:num_acc], rest[num_acc]

                def issue():
                    for b_smem, acc in zip(b_smems, accs, strict=True):
                        plgpu.wgmma(acc, a_smem.at[wg_rows], b_smem)

                # A warpgroup whose rows are all padding leaves its accumulators at zero,
                # which the padding rows' outputs are anyway.
                if cfg.skip_empty_warpgroups:
                    pl.when(wg_has_rows)(issue)
                else:
                    issue()
                # Each wgmma is one group: leaving this step's num_acc groups in flight
                # waits for the previous step's, whose buffers the pipeline then releases
                # (delay_release); the epilogue's read of the accumulators waits for all.
                plgpu.wgmma_wait(cfg.wgmma_in_flight * num_acc)
                return accs

            weights = [
                b_gmem.at[expert, :, pl.ds(offset + col * tile_n, tile_n)]
                for offset in column_offsets
            ]

            @pl.when(expert >= 0)
            def _live():
                pipeline(mma, compute_context)(
                    a_gmem.at[rows, :], *weights, allocations=allocations
                )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def walk_tiles(num_tiles: int, num_col_tiles: int, grid_tile_width: int, visit) -> None:
    """Calls ``visit(row tile, column tile, stores)`` for each pair of the persistent grid:
    the clusters walk the (row tile, column pair) pairs in ``plgpu.planar_snake`` order, and
    the two CTAs of a cluster take the pair's two neighbouring column tiles.

    With an odd number of column tiles the last pair has one: its second CTA still runs the
    pipeline (the cluster loads the row tile for both) over the last column tile again, and
    must not store it. ``stores`` is then a traced bool, false for that CTA (``when_stored``);
    with an even number it is None (every CTA stores).
    """
    cta = lax.axis_index(CLUSTER)
    pairs = arith.ceil_div(num_col_tiles, 2)

    @plgpu.nd_loop((num_tiles * pairs,), collective_axes=CLUSTER_GRID)
    def _tile_loop(loop_info):
        tile, pair = plgpu.planar_snake(loop_info.index[0], (num_tiles, pairs), 0, grid_tile_width)
        col = pair * 2 + cta
        if num_col_tiles % 2 == 0:
            visit(tile, col, None)
        else:
            visit(tile, jnp.minimum(col, num_col_tiles - 1), col < num_col_tiles)


def when_stored(stores, store) -> None:
    """Runs ``store()``, under ``pl.when(stores)`` unless ``stores`` is None (``walk_tiles``)."""
    if stores is None:
        store()
    else:
        pl.when(stores)(store)


def store_tile(out, out_smem, out_tile_gmem, warpgroup, tile_m: int, tile_n: int) -> None:
    """Writes one warpgroup's ``[tile_m, tile_n]`` result through shared memory in
    ``EPILOGUE_TILE``-square pieces, double-buffered (a TMA store per piece)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    wg_out = out_tile_gmem.at[pl.ds(warpgroup * tile_m, tile_m)]
    pieces = [
        (r, c) for r in range(tile_m // EPILOGUE_TILE) for c in range(tile_n // EPILOGUE_TILE)
    ]
    for index, (r, c) in enumerate(pieces):
        piece_rows = slice(r * EPILOGUE_TILE, (r + 1) * EPILOGUE_TILE)
        piece_cols = slice(c * EPILOGUE_TILE, (c + 1) * EPILOGUE_TILE)
        buffer = index % 2
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        out_smem[warpgroup, buffer] = out[piece_rows, piece_cols]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[warpgroup, buffer], wg_out.at[piece_rows, piece_cols])


def _swiglu(gate, up):
    return gate * jax.nn.sigmoid(gate) * up


def _identity(acc):
    return acc


def num_clusters(interpret: bool) -> int:
    """Clusters of the persistent grid: one per two SMs (a small grid in the interpreter)."""
    if interpret:
        return 2
    return jax.devices()[0].core_count // 2


def _fits(out_cols: int, contraction: int, cfg: gemm_config.MosaicGemmConfig) -> bool:
    """Whether ``tile_n`` divides ``out_cols`` and ``tile_k`` the contraction."""
    return out_cols % cfg.tile_n == 0 and contraction % cfg.tile_k == 0


def runs_dtype(dtype) -> bool:
    """Whether the kernels take ``dtype`` on a GPU (the interpreter takes float32 too)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def tiles(hidden: int, ffn: int, cfg: gemm_config.MosaicFfnConfig) -> bool:
    """Whether both kernels tile an FFN of ``hidden`` and ``ffn`` (one expert's width)."""
    return _fits(ffn, hidden, cfg.gate_up) and _fits(hidden, ffn, cfg.down)


def _grouped_matmul(tile_expert, tile_live_rows, a_rows, weights, *, out_cols, column_offsets,
                    epilogue, cfg, interpret):  # fmt: skip
    """``[num_tiles * block_m, out_cols]``: each live row tile times its expert's weights
    (``tile_live_rows [num_tiles]``: the rows of each tile that hold a slot, read with
    ``cfg.skip_empty_warpgroups`` only)."""
    if not _fits(out_cols, a_rows.shape[1], cfg):
        raise impls.KernelUnavailableError(
            f"impl='mosaic' tiles {out_cols} columns by {cfg.tile_n} and the contraction "
            f"{a_rows.shape[1]} by {cfg.tile_k}; use impl='pallas'"
        )
    body = functools.partial(
        _grouped_matmul_body, column_offsets=column_offsets, epilogue=epilogue, cfg=cfg,
        num_col_tiles=out_cols // cfg.tile_n,
    )  # fmt: skip
    out_type = jax.ShapeDtypeStruct((a_rows.shape[0], out_cols), a_rows.dtype)
    live_rows = (tile_live_rows,) if cfg.skip_empty_warpgroups else ()
    return persistent_kernel(body, out_type, interpret)(tile_expert, *live_rows, a_rows, weights)


def persistent_kernel(body, out_type, interpret: bool):
    """``body`` as a Mosaic GPU kernel over the persistent grid of 2-CTA clusters, three
    warpgroups per CTA (two compute, one memory), warpgroup lowering semantics."""
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_clusters(interpret),),
        grid_names=(CLUSTER_GRID,),
        cluster=(2,),
        cluster_names=(CLUSTER,),
        num_threads=3,
        thread_name=WARPGROUP,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def tile_rows(counts: jax.Array, capacity: int, block_m: int, num_tiles: int):
    """The tile-major layout of expert slots.

    Args:
      counts: ``[E]`` int32 rows per expert, in ``[0, capacity]``.
      capacity: slots per expert (C).
      block_m: rows per tile.
      num_tiles: tiles in the layout (static); an expert's rows past them are not placed.

    Returns:
      ``(tile_expert [num_tiles], slot_of_row [num_tiles * block_m], row_of_slot [E, C])``
      int32: each tile's expert (-1 dead), the flat slot ``e * C + j`` each row holds (-1 a
      padding row), and the row each slot went to (-1: past its count or past the tiles).
    """
    num_experts = counts.shape[0]
    group_start = jnp.arange(num_experts, dtype=jnp.int32) * capacity
    table = tile_table.row_tiles(group_start, counts, block_m, num_tiles)
    tile_expert, start, end = table[0], table[1], table[2]
    slot = start[:, None] + jnp.arange(block_m, dtype=jnp.int32)[None, :]
    live = (tile_expert[:, None] >= 0) & (slot < end[:, None])
    slot_of_row = jnp.where(live, slot, -1).reshape(-1)
    first_tile, _ = tile_table.tile_spans(counts, block_m)
    position = jnp.arange(capacity, dtype=jnp.int32)[None, :]
    row = first_tile[:, None] * block_m + position
    placed = (position < counts[:, None]) & (row < num_tiles * block_m)
    return tile_expert, slot_of_row, jnp.where(placed, row, -1).astype(jnp.int32)


def unfused(index: jax.Array) -> jax.Array:
    """``index``, computed once: without the barrier XLA fuses the index arithmetic into the
    row gather and redoes it for every element of every row."""
    return jax.lax.optimization_barrier(index)


def grouped_ffn_mosaic(x_slots, counts, w_gate_up, w_down, *, max_rows, cfg, interpret):
    """The Mosaic GPU impl: ``SlotRows`` of the outputs (tile-major rows and a row per slot).

    ``x_slots`` a slot buffer ``[E, C, H]`` or ``SlotRows``; ``counts`` clipped to ``[0, C]``.
    """
    num_experts, capacity, hidden = x_slots.shape
    if not interpret and not runs_dtype(x_slots.dtype):
        raise impls.KernelUnavailableError(
            f"impl='mosaic' multiplies 16-bit floats on GPUs, got {x_slots.dtype} (wgmma reads "
            "float32 as TF32 only from K-major weights); use impl='pallas'"
        )
    ffn = w_gate_up.shape[3]
    block_m = cfg.gate_up.block_m
    num_tiles = tile_table.max_tiles(num_experts, capacity, block_m, max_rows)
    tile_expert, slot_of_row, row_of_slot = tile_rows(counts, capacity, block_m, num_tiles)
    source_rows, source = slot_rows.flat_slot_source(x_slots, slot_of_row)
    rows = tile_gather.gather_tiles(source_rows, unfused(source), tile_expert, block_m)
    tile_live_rows = None  # only the kernels that skip empty warpgroups read it
    if cfg.gate_up.skip_empty_warpgroups or cfg.down.skip_empty_warpgroups:
        tile_live_rows = jnp.sum(
            slot_of_row.reshape(num_tiles, block_m) >= 0, axis=1, dtype=jnp.int32
        )
    hidden_rows = _grouped_matmul(
        tile_expert, tile_live_rows, rows, w_gate_up.reshape(num_experts, hidden, 2 * ffn),
        out_cols=ffn, column_offsets=(0, ffn), epilogue=_swiglu, cfg=cfg.gate_up,
        interpret=interpret,
    )  # fmt: skip
    out_rows = _grouped_matmul(
        tile_expert, tile_live_rows, hidden_rows, w_down, out_cols=w_down.shape[2],
        column_offsets=(0,), epilogue=_identity, cfg=cfg.down, interpret=interpret,
    )  # fmt: skip
    return slot_rows.SlotRows(out_rows, row_of_slot)
