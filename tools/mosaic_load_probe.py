"""Probe: how long the Mosaic GPU expert kernels take with their loads alone, on a GPU.

``PYTHONPATH=. python tools/mosaic_load_probe.py [--preset qwen3-30b-a3b] [--tokens 4096,16384]
[--expert-dtype bfloat16] [--spec default]``

The in-kernel profile (``tools/mosaic_profile_probe.py``) shows the compute warpgroups waiting
on the pipeline's barriers for a large share of their span at prefill sizes. This probe asks
whether the loads alone take that long: it compiles the grouped FFN (``grouped_gemm``'s kernel
path, ``impl="mosaic"``) twice on the same routed rows (``tools/fp8_layer_probe.py``'s
capacity slots) and weights (``bench grouped_gemm``'s):

* ``full``: the kernels as shipped;
* ``loads only``: the same kernels with the compute warpgroups' products taken out (bf16: no
  ``wgmma`` issued or waited; FP8: no block product, no promotion), so each pipeline step's
  buffers go back to the memory warpgroup as soon as they arrive; the TMA loads, the
  pipeline's barriers, the epilogues and their stores stay.

Both are timed in turns (``device_rates.time_fns_interleaved``). ``loads only / full`` near 1
says the loads hold the kernels; well under 1, the products do. The loads-only output is
checked to be zero and the full output not, so a variant that kept its products (a cached
lowering) shows.
"""

import argparse
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from jtbo.bench import device_rates, expert_presets
from jtbo.bench import grouped_gemm as bench_grouped_gemm
from jtbo.kernels import gemm_config, grouped_gemm, grouped_gemm_mosaic, grouped_gemm_mosaic_fp8
from tools import fp8_layer_probe


@contextlib.contextmanager
def _loads_only():
    """Inside: the Mosaic kernels traced without their products (module attributes swapped,
    restored on exit)."""
    saved = [
        (plgpu, "wgmma", plgpu.wgmma),
        (grouped_gemm_mosaic, "wgmma_wait", grouped_gemm_mosaic.wgmma_wait),
        (grouped_gemm_mosaic_fp8, "_block_product", grouped_gemm_mosaic_fp8._block_product),
        (grouped_gemm_mosaic_fp8, "_promoted", grouped_gemm_mosaic_fp8._promoted),
    ]
    plgpu.wgmma = lambda *args, **kwargs: None
    grouped_gemm_mosaic.wgmma_wait = lambda groups: None
    grouped_gemm_mosaic_fp8._block_product = lambda a_smem, b_smem, shape: None
    grouped_gemm_mosaic_fp8._promoted = lambda running, part, factor: running
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _compiled(layer, args, loads_only: bool):
    """``layer`` jitted, lowered and compiled now (inside ``_loads_only`` if asked), traced
    anew: a fresh wrapper, since jax keeps one trace per function."""
    with _loads_only() if loads_only else contextlib.nullcontext():
        return jax.jit(functools.partial(layer)).lower(*args).compile()


def _live_rows(out) -> np.ndarray:
    """The rows of the kernels' output ``SlotRows`` that some live slot names, as float32
    (the rows of dead tiles are never written)."""
    slot_row = np.asarray(out.slot_row).reshape(-1)
    return np.asarray(out.rows, np.float32)[slot_row[slot_row >= 0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=expert_presets.PRESETS)
    parser.add_argument("--tokens", default="4096,16384", help="comma list of T")
    parser.add_argument("--expert-dtype", default="bfloat16",
                        choices=["bfloat16", "float8_e4m3fn"])  # fmt: skip
    parser.add_argument("--spec", default="default", help="bench grouped_gemm's mosaic:SPEC")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--small", action="store_true",
        help="4 experts of 256 x 256, top-2, in Mosaic GPU's interpreter (a CPU smoke run)",
    )  # fmt: skip
    args = parser.parse_args()
    fp8 = args.expert_dtype == "float8_e4m3fn"
    name = "--small" if args.small else args.preset
    if args.small:
        shapes = bench_grouped_gemm.Shapes(hidden=256, ffn=256, experts=4, top_k=2)
    else:
        shapes = bench_grouped_gemm.Shapes(**expert_presets.PRESETS[args.preset].shape_flags())
    spec = None if args.spec == "default" else bench_grouped_gemm.mosaic_config(args.spec)
    _, weights = bench_grouped_gemm.make_inputs(
        1, shapes, jnp.bfloat16, jax.random.key(0), args.expert_dtype if fp8 else None
    )
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {name}, "
          f"{args.expert_dtype}, spec {args.spec}")  # fmt: skip
    print("\n| T | rows | full ms | loads only ms | loads only / full |\n|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        x, counts, rows = fp8_layer_probe.slots(
            tokens, shapes.experts, shapes.top_k, shapes.hidden, seed=0
        )
        cfg = spec or gemm_config.default_mosaic_ffn(
            shapes.hidden, shapes.ffn, fp8, rows / shapes.experts
        )
        # The kernels' own path, not grouped_ffn_rows' nested jit: each variant is traced anew.
        layer = functools.partial(
            grouped_gemm._kernel_ffn, impl="mosaic", cfg=cfg, max_rows=rows,
            interpret=args.small, zero_padding=False, fp8_activations=True,
        )  # fmt: skip
        call_args = (x, counts, *weights)
        full, loads = (_compiled(layer, call_args, flag) for flag in (False, True))
        full_rows, load_rows = _live_rows(full(*call_args)), _live_rows(loads(*call_args))
        if not np.abs(full_rows).max() > 0 or np.abs(load_rows).max() > 0:
            raise RuntimeError("the loads-only kernels kept their products (or the full lost them)")
        seconds = device_rates.time_fns_interleaved(
            [(full, call_args), (loads, call_args)], warmup=2, iters=args.iters, reps=args.reps
        )
        print(f"| {tokens} | {rows} | {seconds[0] * 1e3:.3f} | {seconds[1] * 1e3:.3f} | "
              f"{seconds[1] / seconds[0]:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
