"""Probe: the Pallas expert layer at decode sizes with one program computing several
neighbouring column tiles (``GemmConfig.column_tiles`` of the gate / up and the down kernel),
against one tile per program, timed in turns in one process; the layer as the model calls it
(``experts_capacity``, capacity = T, ``impl="pallas"``). Prints each case's ms, its ratio to
the default, its weight bytes over the copy ceiling, the two GEMM kernels' GPU time, and
whether its output is bit-equal to the default's; a markdown table last.

``PYTHONPATH=. python tools/column_tiles_probe.py [--tokens 64,128,256] [--dtypes fp8,bf16]
[--tiles 1:1,2:1,1:2,2:2,4:4]`` (a GPU; ``G:D`` the gate / up and down kernels' tiles)
"""

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import device_rates, expert_presets, trace_calls
from jtbo.bench import grouped_gemm as bg
from jtbo.kernels import gemm_config
from jtbo.models import experts


def _config(dtype: str, tiles: str) -> gemm_config.GroupedFfnConfig:
    """The default Pallas config of ``dtype`` with ``tiles = "G:D"`` column tiles."""
    base = gemm_config.GROUPED_FFN_FP8 if dtype == "fp8" else gemm_config.GROUPED_FFN
    gate_up, down = map(int, tiles.split(":"))
    return dataclasses.replace(
        base,
        gate_up=dataclasses.replace(base.gate_up, column_tiles=gate_up),
        down=dataclasses.replace(base.down, column_tiles=down),
    )


def _gemm_us(fn, call_args, calls: int = 10) -> str:
    """The gate / up and down kernels' GPU microseconds per call."""
    kernels = trace_calls.trace_kernels(functools.partial(fn, *call_args), calls)
    times = {name: 0.0 for name in ("_gate_up_kernel", "_down_kernel")}
    for kernel in kernels:
        for name in times:
            times[name] += kernel.microseconds / calls if kernel.name.startswith(name) else 0.0
    return " / ".join(f"{t:.1f}" for t in times.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="64,128,256")
    parser.add_argument("--dtypes", default="fp8,bf16")
    parser.add_argument("--tiles", default="1:1,2:1,1:2,2:2,4:4")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    args = parser.parse_args()
    shapes = bg.Shapes(**expert_presets.PRESETS[args.preset].shape_flags())
    copy_gbs, _ = device_rates.copy_gbs(1 << 30, iters=20, reps=5)
    device = jax.devices()[0].device_kind
    print(f"device {device}  jax {jax.__version__}  {shapes}  copy {copy_gbs:.0f} GB/s")
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        ids_np, routing_np = bg.route(tokens, shapes, 0.0, tokens)
        ids, routing = jnp.asarray(ids_np), jnp.asarray(routing_np)
        for dtype in args.dtypes.split(","):
            expert_dtype = "float8_e4m3fn" if dtype == "fp8" else None
            x, weights = bg.make_inputs(
                tokens, shapes, jnp.bfloat16, jax.random.key(7), expert_dtype
            )
            call_args = (x, ids, routing, weights)
            gbytes = shapes.weight_bytes(len(np.unique(ids_np)), 1 if expert_dtype else 2) / 1e9
            cases, outputs = [], []
            for tiles in args.tiles.split(","):
                layer = functools.partial(
                    experts.experts_capacity, impl="pallas",
                    config=_config(dtype, tiles),
                )  # fmt: skip
                fn = bg.jit_as_step(layer)
                outputs.append(np.asarray(fn(*call_args), np.float32))
                cases.append((fn, call_args))
            seconds = device_rates.time_fns_interleaved(cases, warmup=2, iters=25, reps=7)
            for tiles, sec, out, (fn, _) in zip(
                args.tiles.split(","), seconds, outputs, cases, strict=True
            ):
                line = (
                    f"| {dtype} | {tokens} | {tiles} | {sec * 1e3:.3f} | {seconds[0] / sec:.3f} "
                    f"| {gbytes / sec / copy_gbs:.2f} | {_gemm_us(fn, call_args)} "
                    f"| {np.array_equal(out, outputs[0])} |"
                )
                rows.append(line)
                print(line, flush=True)
    print(
        "| experts | tokens | tiles G:D | ms | first / case | of copy | GEMM GPU us | bit-equal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
