"""Probe: how fast TMA streams FP8 weight tiles from the stored order against a tile-major copy.

The Mosaic GPU FP8 kernels load each ``[128, 128]`` weight tile (128 output columns, one
128-deep contraction block) from weights stored contraction-last, ``[E * N, K]``: 128 runs of
128 bytes at a stride of ``K`` bytes. A decode layer is bound by these loads. This probe streams
the same tiles with nothing else in the kernel (a persistent grid, one CTA per SM, each CTA
walking its column tiles' contraction steps through ``plgpu.emit_pipeline``), once from the
stored order (``strided``) and once from a copy in which every tile is 16 KiB of contiguous
bytes (``tile-major``), beside XLA's copy bandwidth, in one process; prints a markdown table
last. A tile-major layout faster than the stored one would say the weights' layout, not the
kernels' arithmetic, holds the decode layer under copy bandwidth.

``--row-rows R,...`` adds cases that load, beside each weight tile, a ``[R, 128]`` block of
row operands as the kernels do (their row tile's contraction step; the kernels' 128-row tile
is 64 rows a CTA of the cluster's multicast): the row tile of a weight tile's expert, from an
``[E * R, K]`` buffer, so a few row tiles are read by many CTAs at once and mostly hit the L2
cache. Only the weight bytes count in the table's rates. A rate that falls with ``R`` says the
row tiles' traffic, which at decode is mostly padding rows, holds the layer under copy.

``PYTHONPATH=. python tools/tma_layout_probe.py [--stages 4,8] [--ctas 128] [--row-rows 32,64]``
(``--interpret``: Mosaic GPU's interpreter on the CPU, tiny shapes, a check only.)
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jtbo.bench import device_rates
from jtbo.kernels import grouped_gemm_mosaic

TILE = 128  # rows (output columns) and bytes (one FP8 contraction block) of a weight tile
# (name, experts, N rows an expert, K bytes a row): DeepSeek-V3's gate / up and down weights
# (experts cut so that each case streams about 1.9 GB).
CASES = (("dsv3 gate/up", 64, 2 * 2048, 7168), ("dsv3 down", 128, 7168, 2048))
TINY_CASES = (("tiny", 2, 256, 384),)


def _index_map(layout: str, cta, num_ctas: int, k_steps: int):
    """The block index of a CTA's step ``(i, k)``: its ``i``-th column tile's ``k``-th block."""
    if layout == "strided":  # weights [E * N, K]: the tile's rows, the step's 128 bytes
        return lambda i, k: (cta + i * num_ctas, k)
    # weights [tiles * k_steps * 128, 128]: tile t's step k is block t * k_steps + k
    return lambda i, k: ((cta + i * num_ctas) * k_steps + k, 0)


def stream(weights, row_tiles, layout: str, *, num_ctas: int, k_steps: int, stages: int,
           experts: int, interpret: bool):  # fmt: skip
    """Streams every tile of ``weights`` (and with ``row_tiles`` ``[E * R, K]``, each weight
    tile's expert's ``[R, 128]`` row block beside it) through shared memory; returns each CTA's
    step count ``[num_ctas, 128]`` (int32, the count repeated), which must be its tiles times
    ``k_steps``."""
    num_tiles = weights.size // (TILE * TILE * k_steps)
    if num_tiles % num_ctas:
        raise ValueError(f"{num_tiles} column tiles do not divide over {num_ctas} CTAs")
    transforms = grouped_gemm_mosaic.smem_transforms(TILE, weights.dtype.itemsize)
    operands = (weights,) if row_tiles is None else (weights, row_tiles)

    def body(*refs):
        *in_gmems, out_gmem, count_smem = refs
        cta = lax.axis_index("sm")
        specs = [
            plgpu.BlockSpec(
                (TILE, TILE), _index_map(layout, cta, num_ctas, k_steps), transforms=transforms
            )
        ]
        if row_tiles is not None:
            rows = row_tiles.shape[0] // experts
            tiles_per_expert = num_tiles // experts
            specs.append(
                plgpu.BlockSpec(
                    (rows, TILE),
                    lambda i, k: ((cta + i * num_ctas) // tiles_per_expert, k),
                    transforms=transforms,
                )
            )
        steps = plgpu.emit_pipeline(
            lambda _indices, *tiles_and_count: tiles_and_count[-1] + 1,
            grid=(num_tiles // num_ctas, k_steps),
            in_specs=specs,
            max_concurrent_steps=stages,
            init_carry=jnp.int32(0),
        )(*in_gmems)
        count_smem[...] = jnp.full((TILE,), steps, jnp.int32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(count_smem, out_gmem.at[cta])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_ctas, TILE), jnp.int32),
        scratch_types=[plgpu.SMEM((TILE,), jnp.int32)],
        grid=(num_ctas,),
        grid_names=("sm",),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*operands)


def tile_major(strided: jax.Array, k_steps: int) -> jax.Array:
    """``[E * N, K]`` -> ``[tiles * k_steps * 128, 128]``: tile ``t``'s block ``k`` contiguous."""
    rows = strided.shape[0]
    blocks = strided.reshape(rows // TILE, TILE, k_steps, TILE).transpose(0, 2, 1, 3)
    return blocks.reshape(-1, TILE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="4,8")
    parser.add_argument("--ctas", type=int, default=128)
    parser.add_argument("--row-rows", default="", help="row-block rows of the extra cases")
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args()
    interpret = args.interpret
    cases, num_ctas = (TINY_CASES, 2) if interpret else (CASES, args.ctas)
    copy_gbs = None
    if not interpret:
        copy_gbs, label = device_rates.copy_gbs(1 << 30, iters=40, reps=5)
        print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  copy {copy_gbs:.0f} "
              f"GB/s ({label})  {num_ctas} CTAs")  # fmt: skip
    lines = []
    for name, experts, n, k in cases:
        k_steps = k // TILE
        bits = jax.random.bits(jax.random.key(k), (experts * n, k), jnp.uint8)
        strided = lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
        layouts = {"strided": strided, "tile-major": tile_major(strided, k_steps)}
        # (layout, row-block rows): the row blocks beside the stored order only
        variants = [(layout, 0) for layout in layouts]
        variants += [("strided", rows) for rows in map(int, filter(None, args.row_rows.split(",")))]
        fns, labels = [], []
        for stages in map(int, args.stages.split(",")):
            for layout, rows in variants:
                row_bits = jax.random.bits(jax.random.key(rows), (experts * rows, k), jnp.uint8)
                row_tiles = lax.bitcast_convert_type(row_bits, jnp.float8_e4m3fn) if rows else None
                fn = jax.jit(
                    functools.partial(
                        stream, layout=layout, num_ctas=num_ctas, k_steps=k_steps,
                        stages=stages, experts=experts, interpret=interpret,
                    )
                )  # fmt: skip
                counts = np.asarray(fn(layouts[layout], row_tiles))
                want = experts * n // TILE // num_ctas * k_steps
                if not (counts == want).all():
                    raise SystemExit(f"{name} {layout} r{rows} s{stages}: step counts "
                                     f"{counts[:, 0]}, want {want}")  # fmt: skip
                fns.append((fn, (layouts[layout], row_tiles)))
                labels.append((layout + (f" + {rows}-row blocks" if rows else ""), stages))
        if interpret:
            print(f"{name}: every CTA streamed its steps ({len(fns)} launch shapes)")
            continue
        seconds = device_rates.time_fns_interleaved(fns, warmup=3, iters=20, reps=7)
        nbytes = strided.size
        for (layout, stages), sec in zip(labels, seconds, strict=True):
            gbs = nbytes / sec / 1e9
            of_copy = gbs / copy_gbs
            line = f"| {name} | {layout} | {stages} | {sec * 1e3:.3f} | {gbs:.0f} | {of_copy:.2f} |"
            lines.append(line)
            print(line, flush=True)
    if lines:
        print("| weights | layout | stages | ms | GB/s | of copy |")
        print("|---|---|---|---|---|---|")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
