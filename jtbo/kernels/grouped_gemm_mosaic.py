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
warpgroups of ``tile_m x tile_n`` each, stacked by rows (``block_m = 2 * tile_m``; the FP8
kernels may put them side by side instead, ``split_columns``, ``warpgroup_part``), and one
memory warpgroup that runs the TMA pipeline over the contraction
(``emit_pipeline_warp_specialized``); with ``wgmma_in_flight`` a compute warpgroup issues a
step's ``wgmma`` before the previous step's has finished, and the pipeline releases a stage's
buffers one step later. With ``prefetch_across_tiles`` a CTA's tiles form one pipeline (Mosaic
GPU's pipeline of pipelines, over the live tiles only): the memory warpgroup loads the next
tile's first stages while the compute warpgroups finish the current tile and store it; a step
left in flight then has the compute warpgroups release each stage themselves, a step late, and
the last one before the epilogue. The two CTAs of a cluster take neighbouring column tiles of
the same row tile: the row tile is loaded once for both (``collective_axes``), the weight
columns per CTA. With an odd number of column tiles there are no pairs: each CTA walks the
(row tile, column tile) pairs on its own and loads its own row tiles (``pairs_columns``), so
that no CTA computes a tile twice (a pair's second CTA would otherwise repeat the last column
tile's products and loads without storing them; the row tiles loaded twice instead cost
less, as measured at prefill and decode sizes).
A dead tile (expert -1) is skipped: its output rows are left unwritten, and nothing reads
them. The gate / up kernel keeps a gate and an up accumulator and writes ``silu(gate) * up``
in the input dtype; the down kernel writes its accumulator.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jtbo.kernels import gemm_config, impls, slot_rows, tile_gather, tile_table

_F32 = jnp.float32
CLUSTER = "cluster"  # the 2 CTAs of a cluster
CLUSTER_GRID = "cluster_grid"  # the clusters of the persistent grid
WARPGROUP = "wg"  # the 2 compute warpgroups and the memory warpgroup of a CTA
EPILOGUE_TILE = gemm_config.MOSAIC_EPILOGUE_TILE
# Named scopes of a compute warpgroup's phases: Mosaic GPU's profiler (``CompilerParams``'s
# ``profile_space`` / ``profile_dir``, tools/mosaic_profile_probe.py) records each as a time
# range per warpgroup; without the profiler they only name locations. (The FP8 kernels' fresh
# accumulators are zeroed outside these scopes, before their wgmma is issued.)
SCOPE_WGMMA_ISSUE = "wgmma_issue"  # a step's wgmma issued
SCOPE_WGMMA_WAIT = "wgmma_wait"  # waiting for issued wgmma to finish
SCOPE_PROMOTE = "promote"  # FP8: a block's product scaled into the running sum
SCOPE_SCALES = "scales"  # FP8: a step's row and weight-block scales loaded
SCOPE_EPILOGUE = "epilogue"  # a tile's accumulators stored


def smem_transforms(minor_elems: int, itemsize: int) -> tuple:
    """Shared-memory tiling and swizzle of a tile whose minor dimension is ``minor_elems``."""
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _grouped_matmul_body(tile_expert_gmem, *refs, column_offsets, epilogue, cfg, num_col_tiles):
    # tile_expert_gmem: [num_tiles] int32 expert of each row tile (-1: dead); refs: first the
    # optional tile operands (tile_refs), then a_gmem: [num_tiles * block_m, K] tile-major
    # rows; b_gmem: [E, K, N_b] weights; out_gmem: [num_tiles * block_m, N] with
    # N = num_col_tiles * block_n. Accumulator i reads the weight columns
    # column_offsets[i] + (column tile) * block_n.
    num_live_gmem = tile_refs(cfg, refs)
    a_gmem, b_gmem, out_gmem = refs[-3:]
    block_m, block_n, tile_k = cfg.block_m, cfg.block_n, cfg.tile_k
    num_tiles = tile_expert_gmem.shape[0]
    k_steps = a_gmem.shape[1] // tile_k
    itemsize = jnp.dtype(a_gmem.dtype).itemsize
    operand_transforms = smem_transforms(tile_k, itemsize)
    weight_transforms = smem_transforms(block_n, itemsize)
    num_acc = len(column_offsets)
    # A pipeline of pipelines takes no delay_release: with a step in flight the compute
    # warpgroups then release each step's buffers themselves, a step late (release_step).
    manual_release = bool(cfg.prefetch_across_tiles and cfg.wgmma_in_flight)
    delay_release = 0 if cfg.prefetch_across_tiles else cfg.wgmma_in_flight

    def pipeline(body, compute_context, pipeline_state=None):
        a_spec = plgpu.BlockSpec(
            (block_m, tile_k), lambda k: (0, k), transforms=operand_transforms,
            memory_space=plgpu.SMEM, collective_axes=row_collective_axes(num_col_tiles),
            delay_release=delay_release,
        )  # fmt: skip
        b_spec = plgpu.BlockSpec(
            (tile_k, block_n), lambda k: (k, 0), transforms=weight_transforms,
            memory_space=plgpu.SMEM, delay_release=delay_release,
        )  # fmt: skip
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=cfg.memory_registers,
            in_specs=[a_spec] + [b_spec] * num_acc, wg_axis=WARPGROUP, num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps, compute_context=compute_context,
            pipeline_state=pipeline_state, manual_consumed_barriers=manual_release,
        )  # fmt: skip

    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(a_gmem, *[b_gmem.at[0]] * num_acc),
        out_smem=epilogue_smem(out_gmem.dtype),
        collective_axes=WARPGROUP,
    )
    def _scope(allocations, out_smem):
        warpgroup = lax.axis_index(WARPGROUP)
        release_step = functools.partial(_release_step, allocations, cfg.max_concurrent_steps)

        def visit(tile, col, pipeline_state=None):
            expert = tile_expert_gmem[tile]
            rows = pl.ds(tile * block_m, block_m)
            wg_rows, _ = warpgroup_part(cfg, warpgroup)  # rows: no split_columns here

            def compute_context(run_pipeline):
                acc_shape = (cfg.tile_m, cfg.tile_n)

                @functools.partial(pl.run_scoped, accs=[plgpu.ACC(acc_shape, _F32)] * num_acc)
                def _acc_scope(accs):
                    run_pipeline(tuple(accs))
                    if manual_release:  # the last step's buffers, before the epilogue
                        plgpu.wgmma_wait(0)
                        release_step(k_steps - 1)
                    wg_out = out_gmem.at[rows, pl.ds(col * block_n, block_n)].at[wg_rows]

                    def store():
                        out = epilogue(*[acc[...] for acc in accs]).astype(out_gmem.dtype)
                        store_tile(out, out_smem, wg_out, warpgroup)

                    jax.named_scope(SCOPE_EPILOGUE)(store)()

            def mma(indices, a_smem, *rest):
                b_smems, accs = rest[:num_acc], rest[-1]  # (manual: barriers between)

                with jax.named_scope(SCOPE_WGMMA_ISSUE):
                    for b_smem, acc in zip(b_smems, accs, strict=True):
                        plgpu.wgmma(acc, a_smem.at[wg_rows], b_smem)
                # Each wgmma is one group: leaving this step's num_acc groups in flight
                # waits for the previous step's, whose buffers are then released
                # (delay_release or release_step); the epilogue's read of the accumulators
                # waits for all.
                wgmma_wait(cfg.wgmma_in_flight * num_acc)
                if manual_release:
                    step = indices[0]
                    pl.when(step > 0)(lambda: release_step(step - 1))
                return accs

            weights = [
                b_gmem.at[expert, :, pl.ds(offset + col * block_n, block_n)]
                for offset in column_offsets
            ]
            run = functools.partial(
                pipeline(mma, compute_context, pipeline_state), a_gmem.at[rows, :], *weights,
                allocations=allocations,
            )  # fmt: skip
            run_unless_dead(run, expert, pipeline_state)

        walk(cfg, k_steps, num_tiles, num_col_tiles, num_live_gmem, visit)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@jax.named_scope(SCOPE_WGMMA_WAIT)
def wgmma_wait(groups: int) -> None:
    """``plgpu.wgmma_wait(groups)``: waits until at most ``groups`` issued ``wgmma`` groups
    are in flight, in the wait's named scope."""
    plgpu.wgmma_wait(groups)


def _release_step(allocations, stages: int, step) -> None:
    """Gives every operand's stage buffers of contraction step ``step`` back to the memory
    warpgroup (the compute warpgroups' release when a pipeline of pipelines leaves a step's
    ``wgmma`` in flight)."""
    slot = lax.rem(step, stages)
    for barrier in allocations["flat_consumed_barrier_refs"]:
        plgpu.barrier_arrive(barrier.at[slot])


def walk(cfg, k_steps: int, num_tiles: int, num_col_tiles: int, num_live_gmem, visit) -> None:
    """``walk_live_tiles`` over ``num_live_gmem [1]``'s tiles where ``cfg`` prefetches across
    tiles, else ``walk_tiles`` over all ``num_tiles``.

    Raises:
      KernelUnavailableError: prefetching over ``k_steps`` contraction steps that the
        pipeline's ``max_concurrent_steps`` stages do not divide.
    """
    if not cfg.prefetch_across_tiles:
        walk_tiles(num_tiles, num_col_tiles, cfg.grid_tile_width, visit)
        return
    if k_steps % cfg.max_concurrent_steps:
        raise impls.KernelUnavailableError(
            f"prefetch_across_tiles needs contraction steps ({k_steps}) that "
            f"max_concurrent_steps ({cfg.max_concurrent_steps}) divides"
        )
    walk_live_tiles(num_live_gmem[0], num_col_tiles, cfg.grid_tile_width, visit)


def pairs_columns(num_col_tiles: int) -> bool:
    """Whether the two CTAs of a cluster take neighbouring column tiles of one row tile (an
    even number of column tiles), the row tile loaded once for both; else each CTA walks on
    its own."""
    return num_col_tiles % 2 == 0


def row_collective_axes(num_col_tiles: int) -> tuple[str, ...]:
    """The ``collective_axes`` of the row tiles' ``BlockSpec``: the cluster, whose CTAs share
    each row tile, where ``pairs_columns``; none otherwise."""
    return (CLUSTER,) if pairs_columns(num_col_tiles) else ()


def _walkers(num_col_tiles: int) -> tuple[str, ...]:
    """The axes whose index spreads the walk positions: the clusters (a position is a column
    pair) where ``pairs_columns``, else every CTA (a position is one column tile)."""
    return (CLUSTER_GRID,) if pairs_columns(num_col_tiles) else (CLUSTER_GRID, CLUSTER)


def _positions_per_tile(num_col_tiles: int) -> int:
    """A row tile's walk positions: its column pairs, or its column tiles where the CTAs walk
    alone."""
    return num_col_tiles // 2 if pairs_columns(num_col_tiles) else num_col_tiles


def _tile_and_column(index, num_tiles, num_col_tiles: int, grid_tile_width: int):
    """``(row tile, column tile)`` of walk position ``index``: positions cover the row tiles'
    positions (``_positions_per_tile``) in ``plgpu.planar_snake`` order; a position that is a
    column pair gives the cluster's two CTAs its two column tiles."""
    shape = (num_tiles, _positions_per_tile(num_col_tiles))
    tile, position = plgpu.planar_snake(index, shape, 0, grid_tile_width)
    if pairs_columns(num_col_tiles):
        return tile, position * 2 + lax.axis_index(CLUSTER)
    return tile, position


def walk_tiles(num_tiles: int, num_col_tiles: int, grid_tile_width: int, visit) -> None:
    """Calls ``visit(row tile, column tile)`` for each position of the persistent grid: the
    clusters walk the (row tile, column pair) pairs in ``plgpu.planar_snake`` order, the two
    CTAs of a cluster taking the pair's two neighbouring column tiles; with an odd number of
    column tiles every CTA walks the (row tile, column tile) pairs alone (``pairs_columns``).
    """
    positions = num_tiles * _positions_per_tile(num_col_tiles)

    @plgpu.nd_loop((positions,), collective_axes=_walkers(num_col_tiles))
    def _tile_loop(loop_info):
        visit(*_tile_and_column(loop_info.index[0], num_tiles, num_col_tiles, grid_tile_width))


def walk_live_tiles(num_live, num_col_tiles: int, grid_tile_width: int, visit) -> None:
    """``walk_tiles`` over the first ``num_live`` row tiles only (a traced count), calling
    ``visit(row tile, column tile, pipeline_state)`` with the state of Mosaic GPU's pipeline
    of pipelines: a walker's first visit starts the pipeline, its last stops it, the ones
    between keep it running (a walker with a single visit runs a whole pipeline, state None).
    Walker ``w`` of ``n`` (the grid's clusters, or their CTAs where they walk alone:
    ``_walkers``) takes walk positions ``w, w + n, ...``.
    """
    walkers = _walkers(num_col_tiles)
    walker, num_walkers = lax.axis_index(walkers), lax.axis_size(walkers)
    positions = num_live * _positions_per_tile(num_col_tiles)
    visits = lax.div(jnp.maximum(positions - walker + num_walkers - 1, 0), num_walkers)
    states = plgpu.PipelinePipeline

    def visit_at(step, state):
        position = walker + step * num_walkers
        visit(*_tile_and_column(position, num_live, num_col_tiles, grid_tile_width), state)

    pl.when(visits == 1)(lambda: visit_at(0, None))

    @pl.when(visits > 1)
    def _chain():
        visit_at(0, states.START)

        # Guarded: Mosaic GPU's interpreter hangs on a loop of pipelines that runs no step.
        @pl.when(visits > 2)
        def _steady():
            pl.loop(1, visits - 1)(lambda step: visit_at(step, states.STEADY))

        visit_at(visits - 1, states.STOP)


def run_unless_dead(run, expert, pipeline_state) -> None:
    """Runs a visit's pipeline ``run()``: under ``pl.when(expert >= 0)`` on ``walk_tiles``'
    visits (state None), which include dead tiles; unguarded on ``walk_live_tiles``' visits of
    a pipeline of pipelines, which are live. (A single-visit pipeline of ``walk_live_tiles``
    has state None too: its tile is live, so the guard passes.)"""
    if pipeline_state is None:
        pl.when(expert >= 0)(run)
    else:
        run()


def warpgroup_part(cfg: gemm_config.MosaicGemmConfig, warpgroup):
    """``(rows, columns)`` of a CTA's ``block_m x block_n`` tile that compute warpgroup
    ``warpgroup`` computes: a ``tile_m``-row half over all columns, or with ``split_columns``
    a ``tile_n``-column half over all rows."""
    if cfg.split_columns:
        return slice(None), pl.ds(warpgroup * cfg.tile_n, cfg.tile_n)
    return pl.ds(warpgroup * cfg.tile_m, cfg.tile_m), slice(None)


def epilogue_smem(out_dtype):
    """The shared memory of the stores (``store_tile``): per warpgroup two
    ``EPILOGUE_TILE``-square pieces in ``out_dtype``."""
    shape = (2, 2, EPILOGUE_TILE, EPILOGUE_TILE)  # (warpgroup, buffer, rows, columns)
    transforms = smem_transforms(EPILOGUE_TILE, jnp.dtype(out_dtype).itemsize)
    return plgpu.SMEM(shape, out_dtype, transforms=transforms)


def store_tile(out, out_smem, wg_out, warpgroup) -> None:
    """Writes one warpgroup's result ``out [tile_m, tile_n]`` to its part ``wg_out`` of the
    output through shared memory in ``EPILOGUE_TILE``-square pieces, double-buffered (a TMA
    store per piece)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    tile_m, tile_n = out.shape
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


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` of the gate / up kernels' epilogues, with the sigmoid as
    ``rsqrt(1 + exp(-gate)) ** 2``: no float division (a correctly rounded one took a large
    part of a gate / up tile's time, docs/kernels.md); ``rsqrt`` runs as the special-function
    unit's approximation, and so does ``exp`` (one ``ex2``, no range reduction) under the
    kernels' ``approx_math``: about float32's precision. ``exp(-gate)`` overflowing to
    infinity gives 0, as it should.

    Args:
      gate: a tile's gate accumulator, float32.
      up: its up accumulator, of the same shape.

    Returns:
      ``silu(gate) * up``, float32.
    """
    root = lax.rsqrt(1 + jnp.exp(-gate))
    return gate * (root * root) * up


def _identity(acc):
    return acc


def num_clusters(interpret: bool) -> int:
    """Clusters of the persistent grid: one per two SMs (a small grid in the interpreter)."""
    if interpret:
        return 2
    return jax.devices()[0].core_count // 2


def _fits(out_cols: int, contraction: int, cfg: gemm_config.MosaicGemmConfig) -> bool:
    """Whether ``block_n`` divides ``out_cols`` and ``tile_k`` the contraction."""
    return out_cols % cfg.block_n == 0 and contraction % cfg.tile_k == 0


def runs_dtype(dtype) -> bool:
    """Whether the kernels take ``dtype`` on a GPU (the interpreter takes float32 too)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def tiles(hidden: int, ffn: int, cfg: gemm_config.MosaicFfnConfig) -> bool:
    """Whether both kernels tile an FFN of ``hidden`` and ``ffn`` (one expert's width)."""
    return _fits(ffn, hidden, cfg.gate_up) and _fits(hidden, ffn, cfg.down)


def _grouped_matmul(tile_expert, a_rows, weights, *, out_cols, column_offsets, epilogue, cfg,
                    interpret):  # fmt: skip
    """``[num_tiles * block_m, out_cols]``: each live row tile times its expert's weights."""
    if not _fits(out_cols, a_rows.shape[1], cfg):
        raise impls.KernelUnavailableError(
            f"impl='mosaic' tiles {out_cols} columns by {cfg.block_n} and the contraction "
            f"{a_rows.shape[1]} by {cfg.tile_k}; use impl='pallas'"
        )
    body = functools.partial(
        _grouped_matmul_body, column_offsets=column_offsets, epilogue=epilogue, cfg=cfg,
        num_col_tiles=out_cols // cfg.block_n,
    )  # fmt: skip
    out_type = jax.ShapeDtypeStruct((a_rows.shape[0], out_cols), a_rows.dtype)
    operands = (*tile_operands(tile_expert, cfg), a_rows, weights)
    return persistent_kernel(body, out_type, interpret)(*operands)


def tile_operands(tile_expert: jax.Array, cfg: gemm_config.MosaicGemmConfig) -> tuple:
    """A kernel's first operands: ``tile_expert``, and where ``cfg`` prefetches across tiles
    the live tiles' count ``[1]`` int32 (they are a prefix: ``tile_table.row_tiles``).
    ``tile_refs`` takes the count back."""
    if not cfg.prefetch_across_tiles:
        return (tile_expert,)
    return tile_expert, jnp.sum(tile_expert >= 0, dtype=jnp.int32)[None]


def tile_refs(cfg: gemm_config.MosaicGemmConfig, refs):
    """``num_live_gmem`` from a kernel body's refs after ``tile_expert`` (``tile_operands``'
    optional operand; None where ``cfg`` does not take it)."""
    return refs[0] if cfg.prefetch_across_tiles else None


def persistent_kernel(body, out_type, interpret: bool):
    """``body`` as a Mosaic GPU kernel over the persistent grid of 2-CTA clusters
    (``num_clusters``), three warpgroups per CTA (two compute, one memory), warpgroup
    lowering semantics."""
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_clusters(interpret),),
        grid_names=(CLUSTER_GRID,),
        cluster=(2,),
        cluster_names=(CLUSTER,),
        num_threads=3,
        thread_name=WARPGROUP,
        # approx_math: exp (swiglu's) as the special-function unit's ex2 and float divisions
        # (the FP8 epilogue's row quantization) as div.full, within 2 ulps, as Triton divides.
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True
        ),
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
    if cfg.gate_up.split_columns or cfg.down.split_columns:
        raise impls.KernelUnavailableError(
            "split_columns is a launch shape of the FP8 Mosaic kernels; the bf16 ones stack "
            "their warpgroups by rows"
        )
    ffn = w_gate_up.shape[3]
    block_m = cfg.gate_up.block_m
    num_tiles = tile_table.max_tiles(num_experts, capacity, block_m, max_rows)
    tile_expert, slot_of_row, row_of_slot = tile_rows(counts, capacity, block_m, num_tiles)
    source_rows, source = slot_rows.flat_slot_source(x_slots, slot_of_row)
    rows = tile_gather.gather_tiles(source_rows, unfused(source), tile_expert, block_m)
    hidden_rows = _grouped_matmul(
        tile_expert, rows, w_gate_up.reshape(num_experts, hidden, 2 * ffn),
        out_cols=ffn, column_offsets=(0, ffn), epilogue=swiglu, cfg=cfg.gate_up,
        interpret=interpret,
    )  # fmt: skip
    out_rows = _grouped_matmul(
        tile_expert, hidden_rows, w_down, out_cols=w_down.shape[2],
        column_offsets=(0,), epilogue=_identity, cfg=cfg.down, interpret=interpret,
    )  # fmt: skip
    return slot_rows.SlotRows(out_rows, row_of_slot)
