"""Probe: the FP8 Mosaic GPU grouped GEMMs' contraction step, variants timed in turns.

``PYTHONPATH=. python tools/fp8_mosaic_steps_probe.py [--tokens 4096,16384] [--interpret]``

Each variant is the body of ``grouped_gemm_mosaic_fp8`` with another per-step ``mma``
(``--variants``, a comma-separated list; ``library`` is always timed):

* ``library``: the shipped kernel (``grouped_gemm_mosaic_fp8._fp8_matmul``).
* ``library-tN`` / ``library-sN``: the shipped kernel with ``grid_tile_width`` N or N
  pipeline stages (``max_concurrent_steps``).
* ``serial``: this file's copy of it (each block product into a fresh accumulator, waited,
  promoted, one after the other), to show the copy runs as the library does.
* ``noscale``: the same without the multiply by the scales (the promotion's arithmetic).
* ``rowscale``: the same multiplied by the rows' scales only (no block scale loaded).
* ``direct``: no promotion at all, the running sums in ``wgmma`` accumulators as the bf16
  kernel keeps them (wrong numbers; the ceiling of the tiling with FP8 operands).
* ``overlap``: every block product of a step issued into its own fresh accumulator, then
  each waited for in turn (``wgmma_accumulator_load(wait_n=...)``) and promoted while the
  later ones still run.
* ``k256-overlap``: two weight blocks per pipeline step (``tile_k = 2 * qk``), overlapped.

The bf16 Mosaic kernels on the same tiles are timed beside them. Prints one table per token
count: ms, TFLOP/s of the routed rows' FLOPs, against ``library``, and the largest difference
of the numerically exact variants (all but ``noscale``, ``rowscale`` and ``direct``) from
``library`` over the live tiles' rows.
"""

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jtbo.bench import device_rates
from jtbo.kernels import (
    fp8_blocks,
    gemm_config,
    grouped_gemm_mosaic,
    grouped_gemm_mosaic_fp8,
    tile_table,
)

_F32 = jnp.float32
_WG = grouped_gemm_mosaic.WARPGROUP
_EPI = grouped_gemm_mosaic.EPILOGUE_TILE


def _body(
    tile_expert_gmem, a_gmem, a_scale_gmem, b_gmem, b_scale_gmem, *out_gmems, column_offsets,
    cfg, num_col_tiles, variant, blocks_per_step,
):  # fmt: skip
    block_m, tile_m, tile_n = cfg.block_m, cfg.tile_m, cfg.tile_n
    qk = cfg.tile_k
    tile_k = qk * blocks_per_step
    num_acc = len(column_offsets)
    transforms = grouped_gemm_mosaic.smem_transforms(tile_k, 1)

    def pipeline(body, compute_context):
        a_spec = plgpu.BlockSpec(
            (block_m, tile_k), lambda k: (0, k), transforms=transforms,
            memory_space=plgpu.SMEM, collective_axes=(grouped_gemm_mosaic.CLUSTER,),
        )  # fmt: skip
        scale_spec = plgpu.BlockSpec(
            (blocks_per_step, block_m), lambda k: (k, 0), memory_space=plgpu.SMEM
        )
        b_spec = plgpu.BlockSpec(
            (tile_n, tile_k), lambda k: (0, k), transforms=transforms, memory_space=plgpu.SMEM
        )
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(a_gmem.shape[1] // tile_k,), memory_registers=40,
            in_specs=[a_spec, scale_spec] + [b_spec] * num_acc, wg_axis=_WG,
            num_compute_wgs=2, max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )  # fmt: skip

    ignore = lambda *_, **__: None  # noqa: E731
    allocations = pipeline(ignore, ignore).get_allocations(
        a_gmem, a_scale_gmem, *[b_gmem.at[0]] * num_acc
    )
    out_dtype = out_gmems[0].dtype
    out_transforms = grouped_gemm_mosaic.smem_transforms(_EPI, jnp.dtype(out_dtype).itemsize)

    @functools.partial(
        pl.run_scoped,
        allocations=allocations,
        out_smem=plgpu.SMEM((2, 2, _EPI, _EPI), out_dtype, transforms=out_transforms),
        scale_smem=plgpu.SMEM((2, tile_m), _F32),
        collective_axes=_WG,
    )
    def _scope(allocations, out_smem, scale_smem):
        warpgroup = lax.axis_index(_WG)

        @functools.partial(
            grouped_gemm_mosaic.walk_tiles, tile_expert_gmem.shape[0], num_col_tiles,
            cfg.grid_tile_width,
        )  # fmt: skip
        def _visit(tile, col, stores):
            expert = tile_expert_gmem[tile]
            rows = pl.ds(tile * block_m, block_m)
            wg_rows = pl.ds(warpgroup * tile_m, tile_m)
            scale_rows = [(offset + col * tile_n) // tile_n for offset in column_offsets]
            out_rows = pl.ds(tile * block_m + warpgroup * tile_m, tile_m)

            wg_out = out_gmems[0].at[rows, pl.ds(col * tile_n, tile_n)].at[wg_rows]
            wg_scales = out_gmems[1].at[col, out_rows] if num_acc == 2 else None

            def epilogue(sums):
                grouped_gemm_mosaic.run_when(stores, lambda: grouped_gemm_mosaic_fp8._epilogue(
                    sums, out_smem, scale_smem, warpgroup, wg_out, wg_scales
                ))  # fmt: skip

            def compute_context(run_pipeline):
                if variant == "direct":

                    def accs_scope(*accs):
                        run_pipeline(tuple(accs))
                        epilogue([acc[...] for acc in accs])

                    pl.run_scoped(accs_scope, *[plgpu.ACC((tile_m, tile_n), _F32)] * num_acc)
                    return
                zeros = plgpu.layout_cast(jnp.full((tile_m, tile_n), 0, _F32), plgpu.Layout.WGMMA)
                epilogue(run_pipeline((zeros,) * num_acc))

            def mma(indices, a_smem, a_scale_smem, *rest):
                b_smems, sums = rest[:num_acc], rest[num_acc]
                if variant == "direct":
                    for b_smem, acc in zip(b_smems, sums, strict=True):
                        plgpu.wgmma(acc, a_smem.at[wg_rows], b_smem.transpose((1, 0)))
                    plgpu.wgmma_wait(0)
                    return sums
                step = indices[0]
                layout = plgpu.Layout.WGMMA.reduce(1)
                row_scales = [
                    plgpu.load(a_scale_smem.at[j, wg_rows], layout=layout)
                    for j in range(blocks_per_step)
                ]
                # products in order: (accumulator, block of the step)
                products = [(i, j) for i in range(num_acc) for j in range(blocks_per_step)]
                first_block = step * blocks_per_step
                factors = {
                    (i, j): row_scales[j] * b_scale_gmem[expert, scale_rows[i], first_block + j]
                    for i, j in products
                }

                def a_block(j):
                    a = a_smem.at[wg_rows]
                    return a if blocks_per_step == 1 else a.at[:, pl.ds(j * qk, qk)]

                def b_block(i, j):
                    b = b_smems[i] if blocks_per_step == 1 else b_smems[i].at[:, pl.ds(j * qk, qk)]
                    return b.transpose((1, 0))

                def promote(running, part, i, j):
                    if variant == "noscale":
                        return running + part
                    factor = row_scales[j] if variant == "rowscale" else factors[(i, j)]
                    return running + part * lax.broadcast_in_dim(factor, part.shape, [0])

                out = list(sums)
                if variant in ("serial", "noscale", "rowscale"):
                    for i, j in products:

                        def one(acc, i=i, j=j):
                            plgpu.wgmma(acc, a_block(j), b_block(i, j))
                            return plgpu.wgmma_accumulator_load(acc, wait_n=0)

                        part = pl.run_scoped(one, plgpu.ACC((tile_m, tile_n), _F32))
                        out[i] = promote(out[i], part, i, j)
                    return tuple(out)
                assert variant == "overlap", variant

                def issued(*accs):
                    for acc, (i, j) in zip(accs, products, strict=True):
                        plgpu.wgmma(acc, a_block(j), b_block(i, j))
                    result = list(sums)
                    for n, (acc, (i, j)) in enumerate(zip(accs, products, strict=True)):
                        part = plgpu.wgmma_accumulator_load(acc, wait_n=len(products) - 1 - n)
                        result[i] = promote(result[i], part, i, j)
                    return tuple(result)

                return pl.run_scoped(issued, *[plgpu.ACC((tile_m, tile_n), _F32)] * len(products))

            weights = [
                b_gmem.at[expert, pl.ds(offset + col * tile_n, tile_n), :]
                for offset in column_offsets
            ]

            @pl.when(expert >= 0)
            def _live():
                pipeline(mma, compute_context)(
                    a_gmem.at[rows, :], a_scale_gmem.at[:, rows], *weights,
                    allocations=allocations,
                )  # fmt: skip

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _kernel(variant, blocks_per_step, *, out_cols, column_offsets, out_dtype, cfg, interpret):
    """``(tile_expert, rows, row_scales, values, scales) -> outputs`` of one variant."""
    if variant == "library":
        return functools.partial(
            _library, out_cols=out_cols, column_offsets=column_offsets, out_dtype=out_dtype,
            cfg=cfg, interpret=interpret,
        )  # fmt: skip
    body = functools.partial(
        _body, column_offsets=column_offsets, cfg=cfg, num_col_tiles=out_cols // cfg.tile_n,
        variant=variant, blocks_per_step=blocks_per_step,
    )  # fmt: skip

    def call(tile_expert, rows, row_scales, values, scales):
        out_type = [jax.ShapeDtypeStruct((rows.shape[0], out_cols), out_dtype)]
        if len(column_offsets) == 2:
            out_type.append(jax.ShapeDtypeStruct((out_cols // cfg.tile_n, rows.shape[0]), _F32))
        kernel = grouped_gemm_mosaic.persistent_kernel(body, tuple(out_type), interpret)
        return kernel(tile_expert, rows, row_scales, values, scales)

    return call


def _library(tile_expert, rows, row_scales, values, scales, **kw):
    return grouped_gemm_mosaic_fp8._fp8_matmul(
        tile_expert, rows, row_scales, (values, scales), **kw
    )


def _problem(tokens, experts, top_k, hidden, ffn, block_m, seed=0):
    rng = np.random.default_rng(seed)
    mean = tokens * top_k // experts
    capacity = 4 * mean
    counts = jnp.asarray(np.clip(rng.poisson(mean, experts), 0, capacity).astype(np.int32))
    x = jax.random.normal(jax.random.key(seed), (experts, capacity, hidden), jnp.bfloat16)
    num_tiles = tile_table.max_tiles(experts, capacity, block_m, tokens * top_k)
    tile_expert, slot_of_row, _ = grouped_gemm_mosaic.tile_rows(
        counts, capacity, block_m, num_tiles
    )
    rows, row_scales = jax.jit(grouped_gemm_mosaic_fp8.gathered_fp8_rows, static_argnums=(3, 4))(
        x, slot_of_row, tile_expert, block_m, 128
    )
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    w_gate_up = jax.random.normal(k1, (experts, hidden, 2, ffn), jnp.float32) / hidden**0.5
    w_down = jax.random.normal(k2, (experts, ffn, hidden), jnp.float32) / ffn**0.5
    quantized = [fp8_blocks.quantize_experts(w, (128, 128)) for w in (w_gate_up, w_down)]
    gate_up = fp8_blocks.expert_matrices(quantized[0], 2 * ffn, hidden, "mosaic")
    down = fp8_blocks.expert_matrices(quantized[1], hidden, ffn, "mosaic")
    bf16 = (
        w_gate_up.astype(jnp.bfloat16).reshape(experts, hidden, 2 * ffn),
        w_down.astype(jnp.bfloat16),
    )
    bf16_rows = jax.jit(lambda r: (r.astype(_F32) * 0.01).astype(jnp.bfloat16))(rows)
    return tile_expert, rows, row_scales, gate_up, down, bf16, bf16_rows, int(counts.sum())


DEFAULT_VARIANTS = "serial,noscale,rowscale,direct,library-t8,library-t16,library-s3,library-s2"
_CFG_FIELDS = {"t": "grid_tile_width", "s": "max_concurrent_steps"}


def _variant_kernel(name, cfg, interpret, kw):
    """The kernel of one ``--variants`` name (see the module docstring)."""
    if name.startswith("library-"):
        field, value = _CFG_FIELDS[name[len("library-")]], int(name[len("library-") + 1 :])
        cfg = dataclasses.replace(cfg, **{field: value})
        return _kernel("library", 1, cfg=cfg, interpret=interpret, **kw)
    blocks_per_step = 2 if name.startswith("k256-") else 1
    return _kernel(name.removeprefix("k256-"), blocks_per_step, cfg=cfg, interpret=interpret, **kw)


def _variants(names, ffn, hidden, cfg, interpret):
    """``{"<kernel> <variant>": kernel}`` for both kernels, ``library`` first."""
    gate_up = dict(out_cols=ffn, column_offsets=(0, ffn), out_dtype=fp8_blocks.FP8_DTYPE)
    down = dict(out_cols=hidden, column_offsets=(0,), out_dtype=jnp.bfloat16)
    return {
        f"{kernel} {name}": _variant_kernel(name, cfg, interpret, kw)
        for kernel, kw in (("gate_up", gate_up), ("down", down))
        for name in ["library", *names]
    }


def _live_difference(got, want, live_rows) -> float:
    """The largest difference of two kernels' outputs over the live tiles' rows (a dead
    tile's rows are never written)."""
    diffs = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = a.astype(_F32), b.astype(_F32)
        if a.shape[0] != live_rows.shape[0]:  # the hidden scales, [F / tile_n, R]
            a, b = a.T, b.T
        diffs.append(float(jnp.max(jnp.where(live_rows[:, None], jnp.abs(a - b), 0.0))))
    return max(diffs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    args = parser.parse_args()
    cfg = gemm_config.MOSAIC_FFN_FP8.gate_up
    bf16_cfg = gemm_config.MosaicFfnConfig()
    names = [name for name in args.variants.split(",") if name and name != "library"]
    variants = _variants(names, args.ffn, args.hidden, cfg, args.interpret)
    mm = functools.partial(grouped_gemm_mosaic._grouped_matmul, interpret=args.interpret)
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}")
    for tokens in map(int, args.tokens.split(",")):
        tile_expert, rows, row_scales, gate_up, down, bf16, bf16_rows, routed = _problem(
            tokens, args.experts, args.top_k, args.hidden, args.ffn, cfg.block_m
        )
        hidden_rows, hidden_scales = jax.jit(variants["gate_up library"])(
            tile_expert, rows, row_scales, *gate_up
        )
        cases = {}
        for label, fn in variants.items():
            operands = (rows, row_scales, *gate_up) if label.startswith("gate_up") else (
                hidden_rows, hidden_scales, *down)  # fmt: skip
            cases[label] = (jax.jit(fn), (tile_expert, *operands))
        cases["gate_up bf16"] = (
            jax.jit(lambda t, r, w: mm(t, None, r, w, out_cols=args.ffn,
                                       column_offsets=(0, args.ffn),
                                       epilogue=grouped_gemm_mosaic.swiglu, cfg=bf16_cfg.gate_up)),
            (tile_expert, bf16_rows, bf16[0]),
        )  # fmt: skip
        cases["down bf16"] = (
            jax.jit(lambda t, r, w: mm(t, None, r, w, out_cols=args.hidden, column_offsets=(0,),
                                       epilogue=grouped_gemm_mosaic._identity, cfg=bf16_cfg.down)),
            (tile_expert, bf16_rows[:, : args.ffn], bf16[1]),
        )  # fmt: skip
        results, usable = {}, {}
        for label, (fn, fn_args) in cases.items():
            try:
                results[label] = jax.block_until_ready(fn(*fn_args))
                usable[label] = (fn, fn_args)
            except Exception as error:  # a variant that does not compile is reported, not run
                print(f"{label}: {type(error).__name__}: {str(error)[:300]}")
        live_rows = jnp.repeat(tile_expert >= 0, cfg.block_m)
        labels = list(usable)
        seconds = device_rates.time_fns_interleaved(
            [usable[k] for k in labels], warmup=2, iters=10, reps=args.reps
        )
        times = dict(zip(labels, seconds, strict=True))
        flops = {
            "gate_up": 4 * routed * args.hidden * args.ffn,
            "down": 2 * routed * args.hidden * args.ffn,
        }
        print(f"\ntokens {tokens} (routed rows {routed}, tile rows {rows.shape[0]})")
        print("| kernel | variant | ms | TFLOP/s | library / this | max diff from library |")
        print("|---|---|---|---|---|---|")
        for label, t in times.items():
            kernel, variant = label.split(" ", 1)
            base = times.get(f"{kernel} library", float("nan"))
            diff = "—"
            if variant not in ("library", "noscale", "rowscale", "direct", "bf16"):  # exact ones
                diff = _live_difference(results[label], results[f"{kernel} library"], live_rows)
                diff = f"{diff:.3g}"
            print(f"| {kernel} | {variant} | {t * 1e3:.3f} | {flops[kernel] / t / 1e12:.0f} | "
                  f"{base / t:.3f} | {diff} |")  # fmt: skip


if __name__ == "__main__":
    main()
