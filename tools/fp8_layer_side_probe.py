"""Probe: the expert layer as the model calls it (``experts_capacity``, capacity = T, impl
``"auto"``) with bf16 and with FP8 experts, side by side in one process, and the FP8 layer
with its down kernel on one accumulator a CTA (``down_column_offsets`` forced to one tile)
beside the shipped one; prints a markdown table last.

``PYTHONPATH=. python tools/fp8_layer_side_probe.py [--tokens 4096,16384] [--preset NAME]``
"""

import argparse
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import device_rates, expert_presets, kernel_time, trace_calls
from jtbo.bench import grouped_gemm as bg
from jtbo.kernels import grouped_gemm_mosaic_fp8
from jtbo.models import experts


def _compiled(fn, args, single_down: bool):
    """``fn`` jitted as a step is, traced (and compiled) now, with the down kernel's
    accumulators as shipped or one a CTA."""
    jitted = bg.jit_as_step(fn)
    if not single_down:
        return jitted, np.asarray(jitted(*args), np.float32)
    with mock.patch.object(grouped_gemm_mosaic_fp8, "down_column_offsets", lambda h, n: (0,)):
        return jitted, np.asarray(jitted(*args), np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    args = parser.parse_args()
    shapes = bg.Shapes(**expert_presets.PRESETS[args.preset].shape_flags())
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  {args.preset} {shapes}")
    lines = []
    for tokens in map(int, args.tokens.split(",")):
        ids_np, routing_np = bg.route(tokens, shapes, 0.0, tokens)
        ids, routing = jnp.asarray(ids_np), jnp.asarray(routing_np)
        layer = functools.partial(experts.experts_capacity, impl="auto")
        cases, outputs = {}, {}
        for name, dtype, single in (
            ("bf16", None, False),
            ("fp8 one-tile down", "float8_e4m3fn", True),
            ("fp8", "float8_e4m3fn", False),
        ):
            x, weights = bg.make_inputs(tokens, shapes, jnp.bfloat16, jax.random.key(tokens), dtype)
            call_args = (x, ids, routing, weights)
            fn, outputs[name] = _compiled(layer, call_args, single)
            cases[name] = (fn, call_args)
        seconds = device_rates.time_fns_interleaved(
            list(cases.values()), warmup=2, iters=25 if tokens < 1000 else 10, reps=7
        )
        t = dict(zip(cases, seconds, strict=True))
        same = np.array_equal(outputs["fp8"], outputs["fp8 one-tile down"])
        line = (
            f"| {tokens} | {t['bf16'] * 1e3:.3f} | {t['fp8 one-tile down'] * 1e3:.3f} "
            f"| {t['fp8'] * 1e3:.3f} | {t['fp8 one-tile down'] / t['fp8']:.3f} "
            f"| {t['bf16'] / t['fp8']:.3f} | {t['bf16'] / t['fp8 one-tile down']:.3f} | {same} |"
        )
        lines.append(line)
        print(line, flush=True)
        for name in ("fp8 one-tile down", "fp8"):
            fn, call_args = cases[name]
            ks = trace_calls.trace_kernels(functools.partial(fn, *call_args), 10)
            print(f"  {name}: {kernel_time.kernels_per_call(ks, 10, top=6)}", flush=True)
    print(
        "| tokens | bf16 ms | FP8 one-tile down ms | FP8 ms | one-tile / paired | bf16 / FP8 "
        "| bf16 / FP8 one-tile | FP8 bit-equal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
