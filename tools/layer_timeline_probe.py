"""Probe: one call of the expert layer as the model calls it (``experts_capacity``, capacity =
T, ``"auto"``) laid out kernel by kernel: each kernel's start within the call, the idle gap
before it, its GPU time, its name and the jax operation XLA's fusion came from. Prints, per
case, the call's span split into the GEMM kernels, the other kernels and the gaps.

``PYTHONPATH=. python tools/layer_timeline_probe.py [--tokens 64,256] [--dtypes fp8,bf16]
[--preset qwen3-30b-a3b]`` (a GPU)
"""

import argparse
import functools

import jax
import jax.numpy as jnp

from jtbo.bench import expert_presets, kernel_time, trace_calls
from jtbo.bench import grouped_gemm as bg
from jtbo.models import experts

CALLS = 12
# Name parts of the GEMM kernels: the Pallas (Triton) ones and the Mosaic GPU ones.
GEMM_KERNELS = ("_gate_up_kernel", "_down_kernel", "mosaic_gpu_kernel")


def _one_call(kernels: list[kernel_time.Kernel], calls: int) -> list[kernel_time.Kernel]:
    """The kernels of the middle call of ``calls`` back-to-back calls."""
    per_call = len(kernels) // calls
    middle = calls // 2
    return kernels[middle * per_call : (middle + 1) * per_call]


def _short(op_name: str) -> str:
    """The tail of an ``op_name``: the jax function and primitive it came from."""
    parts = [p for p in op_name.split("/") if p and not p.startswith("jit(")]
    return "/".join(parts[-3:])


def timeline(kernels: list[kernel_time.Kernel], op_names: dict[str, str]) -> tuple[str, str]:
    """(one line per kernel, a summary line) of one call's kernels."""
    start, end = kernels[0].start, kernels[0].start
    lines, gemm, other, gaps = [], 0.0, 0.0, 0.0
    for kernel in kernels:
        gap = max(0.0, kernel.start - end)
        gaps += gap
        end = max(end, kernel.start + kernel.microseconds)
        is_gemm = any(part in kernel.name for part in GEMM_KERNELS)
        gemm += kernel.microseconds if is_gemm else 0.0
        other += 0.0 if is_gemm else kernel.microseconds
        op = _short(op_names.get(kernel.name, ""))
        lines.append(
            f"  {kernel.start - start:8.1f} gap {gap:5.1f}  {kernel.microseconds:7.1f} us  "
            f"{kernel.name[:48]:48s} {op}"
        )
    summary = (
        f"span {end - start:.1f} us = GEMM kernels {gemm:.1f} + other kernels {other:.1f} "
        f"+ gaps {gaps:.1f} ({len(kernels)} kernels)"
    )
    return "\n".join(lines), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="64,256")
    parser.add_argument("--dtypes", default="fp8,bf16")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    args = parser.parse_args()
    shapes = bg.Shapes(**expert_presets.PRESETS[args.preset].shape_flags())
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  {args.preset} {shapes}")
    summaries = []
    for tokens in map(int, args.tokens.split(",")):
        ids, routing = map(jnp.asarray, bg.route(tokens, shapes, 0.0, tokens))
        for dtype in args.dtypes.split(","):
            expert_dtype = "float8_e4m3fn" if dtype == "fp8" else None
            x, weights = bg.make_inputs(
                tokens, shapes, jnp.bfloat16, jax.random.key(tokens), expert_dtype
            )
            fn = bg.jit_as_step(functools.partial(experts.experts_capacity, impl="auto"))
            call_args = (x, ids, routing, weights)
            hlo = fn.lower(*call_args).compile().as_text()
            op_names, _ = kernel_time.hlo_op_names(hlo)
            kernels = trace_calls.trace_kernels(functools.partial(fn, *call_args), CALLS)
            lines, summary = timeline(_one_call(kernels, CALLS), op_names)
            print(f"== {dtype} {tokens} tokens\n{lines}\n  {summary}", flush=True)
            summaries.append(f"| {dtype} | {tokens} | {summary} |")
    print("| experts | tokens | one call |")
    print("|---|---|---|")
    print("\n".join(summaries))


if __name__ == "__main__":
    main()
