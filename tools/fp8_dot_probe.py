"""Probe: how fast can a Pallas (Triton) kernel read FP8 expert weights at decode sizes?

``PYTHONPATH=. python tools/fp8_dot_probe.py [--experts 128] [--rows 16] [--hidden 2048]
[--cols 1536]``

One program per (expert, column tile) computes ``x[e] [rows, H] @ w[e] [H, cols tile]`` with
a 128-wide contraction step, the shape of the grouped GEMM's gate / up kernel at decode
(a few rows per expert, every expert's weights read once). Variants:

- ``bf16``: bf16 weights, ``[E, H, N]`` (the float kernel).
- ``w8``: FP8 weights ``[E, H, N]`` widened to bf16 per tile, scaled per 128 x 128 block
  (the weight-only kernel's scheme).
- ``w8a8``: FP8 weights ``[E, H, N]``; each row's 128 channels of x quantized to FP8 with
  their own scale inside the kernel, an FP8 x FP8 dot, both scales applied.
- ``w8a8_kmajor``: as ``w8a8`` with the weights stored ``[E, N, H]`` (contraction-contiguous,
  the layout FP8 ``wgmma`` reads), each tile loaded and transposed.

Prints, per variant, the median time, the weight bytes read per second and the error against
float32 (the FP8 variants against the dequantized weights; w8a8 also carries the activation
rounding).
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.bench import device_rates

BLOCK = 128  # the FP8 block: contraction step and column tile
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


def _kernel(x_ref, w_ref, s_ref, o_ref, *, variant, num_k):
    # x_ref [E, M, H] bf16; w_ref [E, H, N] (kmajor: [E, N, H]); s_ref [E, H/128, N/128] f32;
    # o_ref [E, M, N] f32.
    expert, col = pl.program_id(0), pl.program_id(1)
    rows = x_ref.shape[1]
    n0 = pl.multiple_of(col * BLOCK, BLOCK)

    def step(i, acc):
        k0 = pl.multiple_of(i * BLOCK, BLOCK)
        x = x_ref[expert, :, pl.ds(k0, BLOCK)]
        if variant == "w8a8_kmajor":
            w = w_ref[expert, pl.ds(n0, BLOCK), pl.ds(k0, BLOCK)].T
        else:
            w = w_ref[expert, pl.ds(k0, BLOCK), pl.ds(n0, BLOCK)]
        if variant == "bf16":
            return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
        scale = s_ref[expert, i, col]
        if variant == "w8":
            part = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
            return acc + part * scale
        x32 = x.astype(jnp.float32)
        x_scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=1, keepdims=True), 1e-12) / FP8_MAX
        xq = (x32 / x_scale).astype(FP8)
        part = jnp.dot(xq, w, preferred_element_type=jnp.float32)
        return acc + part * (x_scale * scale)

    acc = jax.lax.fori_loop(0, num_k, step, jnp.zeros((rows, BLOCK), jnp.float32))
    o_ref[expert, :, pl.ds(n0, BLOCK)] = acc


def run(variant, x, w, s, *, warps, stages, interpret=False):
    experts, rows, hidden = x.shape
    cols = s.shape[2] * BLOCK
    kernel = functools.partial(_kernel, variant=variant, num_k=hidden // BLOCK)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((experts, rows, cols), jnp.float32),
        grid=(experts, cols // BLOCK),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
    )(x, w, s)


def quantize(w):
    """FP8 values and [E, H/128, N/128] scales of w [E, H, N] float32."""
    e, h, n = w.shape
    blocks = w.reshape(e, h // BLOCK, BLOCK, n // BLOCK, BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=(2, 4)) / FP8_MAX
    values = (blocks / scale[:, :, None, :, None]).astype(FP8).reshape(e, h, n)
    return values, scale


def dequantize(values, scale):
    e, h, n = values.shape
    blocks = values.astype(jnp.float32).reshape(e, h // BLOCK, BLOCK, n // BLOCK, BLOCK)
    return (blocks * scale[:, :, None, :, None]).reshape(e, h, n)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=1536)
    parser.add_argument("--configs", default="4x3,4x4,8x3,8x4")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--interpret", action="store_true", help="the Pallas interpreter (CPU)")
    args = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 2)
    shape = (args.experts, args.hidden, args.cols)
    x = jax.random.normal(keys[0], (args.experts, args.rows, args.hidden), jnp.bfloat16)
    w32 = jax.random.normal(keys[1], shape, jnp.float32) * 0.05
    values, scale = quantize(w32)
    w_deq = dequantize(values, scale)
    weights = {
        "bf16": (w32.astype(jnp.bfloat16), scale),
        "w8": (values, scale),
        "w8a8": (values, scale),
        "w8a8_kmajor": (jnp.swapaxes(values, 1, 2), scale),
    }
    x32 = x.astype(jnp.float32)
    print(f"shape E={args.experts} rows={args.rows} H={args.hidden} N={args.cols}")
    print("variant        config  ms      weight GB/s  rel err")
    for variant, (w, s) in weights.items():
        wanted = x32 @ (
            w32.astype(jnp.bfloat16).astype(jnp.float32) if variant == "bf16" else w_deq
        )
        nbytes = w.size * w.dtype.itemsize
        for config in args.configs.split(","):
            warps, stages = map(int, config.split("x"))
            run_variant = functools.partial(
                run, variant, warps=warps, stages=stages, interpret=args.interpret
            )
            fn = jax.jit(run_variant)
            try:
                out = fn(x, w, s)
                err = float(jnp.linalg.norm(out - wanted) / jnp.linalg.norm(wanted))
                seconds = device_rates.time_fn(
                    fn, (x, w, s), warmup=1, iters=args.iters, reps=args.reps
                )
            except Exception as error:  # a variant the compiler refuses is a row, not a stop
                print(f"{variant:14s} {config:6s}  error: {str(error).splitlines()[0][:120]}")
                continue
            print(
                f"{variant:14s} {config:6s}  {seconds * 1e3:.3f}  {nbytes / seconds / 1e9:8.0f}"
                f"     {err:.2e}"
            )


if __name__ == "__main__":
    main()
