"""Probe: the Mosaic gate / up epilogue's SwiGLU as shipped against the precise one it
replaced, both layers in one process, timed in turns.

``PYTHONPATH=. python tools/epilogue_probe.py [--preset qwen3-30b-a3b] [--tokens 4096,16384]
[--expert-dtypes bfloat16,float8_e4m3fn]``

For each expert dtype and token count, the grouped FFN (``grouped_gemm.grouped_ffn_rows``,
``impl="mosaic"``, the default launch shapes) on the routed rows and weights of
``tools/fp8_layer_probe.py`` is compiled twice: as shipped (``grouped_gemm_mosaic.swiglu``,
``rsqrt(1 + exp(-gate)) ** 2`` under the kernels' ``approx_math``), and with the epilogue it
replaced (``gate * sigmoid(gate) * up``, ``approx_math`` off), traced under a patched
``swiglu`` and ``CompilerParams`` with JAX's caches cleared around it, so the two programs
share nothing. Both are timed in turns (``device_rates.time_fns_interleaved``). Prints ms of
each, precise / shipped, and the largest difference of their outputs over the outputs'
largest magnitude.
"""

import argparse
import contextlib
import functools

import jax
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from jtbo.bench import device_rates, expert_presets
from jtbo.kernels import grouped_gemm, grouped_gemm_mosaic
from tools import fp8_layer_probe


def _precise_swiglu(gate, up):
    """The epilogue before ``grouped_gemm_mosaic.swiglu``: a precise ``exp`` and division."""
    return gate * jax.nn.sigmoid(gate) * up


@contextlib.contextmanager
def _precise_epilogue():
    """Kernels traced inside compute the precise SwiGLU with ``approx_math`` off."""
    swiglu, params = grouped_gemm_mosaic.swiglu, plgpu.CompilerParams
    grouped_gemm_mosaic.swiglu = _precise_swiglu
    plgpu.CompilerParams = lambda **kwargs: params(**{**kwargs, "approx_math": False})
    jax.clear_caches()
    try:
        yield
    finally:
        grouped_gemm_mosaic.swiglu, plgpu.CompilerParams = swiglu, params
        jax.clear_caches()


def _compiled(layer, args):
    """``layer`` compiled for ``args``, independent of JAX's caches once built."""
    return jax.jit(layer).lower(*args).compile()


def _case(preset, fp8: bool, tokens: int, weights, reps: int) -> str:
    """One table row: the shipped and the precise epilogue's layer at ``tokens``."""
    x, counts, rows = fp8_layer_probe.slots(
        tokens, preset.experts, preset.top_k, preset.hidden, seed=0
    )
    args = (x, counts, *weights)
    layer = functools.partial(grouped_gemm.grouped_ffn_rows, impl="mosaic", max_rows=rows)
    shipped = _compiled(layer, args)
    with _precise_epilogue():
        precise = _compiled(layer, args)
    # The slot layout, zero past the counts: the tile-major rows' padding rows are unwritten.
    outs = [fp8_layer_probe.result(fn, args) for fn in (shipped, precise)]
    difference = np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max()
    times = device_rates.time_fns_interleaved(
        [(shipped, args), (precise, args)], warmup=2, iters=10, reps=reps
    )
    dtype = "float8_e4m3fn" if fp8 else "bfloat16"
    return (
        f"| {dtype} | {tokens} | {times[0] * 1e3:.3f} | {times[1] * 1e3:.3f} | "
        f"**{times[1] / times[0]:.3f}x** | {difference:.2e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=expert_presets.PRESETS)
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--expert-dtypes", default="bfloat16,float8_e4m3fn")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    preset = expert_presets.PRESETS[args.preset]
    bf16_weights, fp8_weights = fp8_layer_probe.weights(preset.experts, preset.hidden, preset.ffn)
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  {args.preset}")
    print("| experts | tokens | shipped ms | precise ms | precise / shipped | max difference |")
    print("|---|---|---|---|---|---|")
    for dtype in args.expert_dtypes.split(","):
        fp8 = dtype == "float8_e4m3fn"
        for tokens in map(int, args.tokens.split(",")):
            weights = fp8_weights if fp8 else bf16_weights
            print(_case(preset, fp8, tokens, weights, args.reps), flush=True)


if __name__ == "__main__":
    main()
