"""Probe: the expert layer as the model calls it (``experts_capacity``, capacity = T, impl
``"auto"``) with bf16 and with FP8 experts, each under several Mosaic GPU pipeline depths
(``max_concurrent_steps`` of both kernels), all side by side in one process; prints a
markdown table last.

``PYTHONPATH=. python tools/fp8_layer_side_probe.py [--tokens 4096,16384] [--preset NAME]
[--stages 4,3]``
"""

import argparse
import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import device_rates, expert_presets, kernel_time, trace_calls
from jtbo.bench import grouped_gemm as bg
from jtbo.kernels import gemm_config
from jtbo.models import experts


def _with_stages(config: gemm_config.MosaicFfnConfig, stages: int):
    return gemm_config.MosaicFfnConfig(
        gate_up=dataclasses.replace(config.gate_up, max_concurrent_steps=stages),
        down=dataclasses.replace(config.down, max_concurrent_steps=stages),
    )


def _compiled(args, stages: int):
    """The layer jitted as a step is, traced and compiled now with both Mosaic defaults at
    ``stages`` pipeline stages; ``(fn, output)``."""
    jitted = bg.jit_as_step(functools.partial(experts.experts_capacity, impl="auto"))
    with (
        mock.patch.object(gemm_config, "MOSAIC_FFN", _with_stages(gemm_config.MOSAIC_FFN, stages)),
        mock.patch.object(
            gemm_config, "MOSAIC_FFN_FP8", _with_stages(gemm_config.MOSAIC_FFN_FP8, stages)
        ),
    ):
        return jitted, np.asarray(jitted(*args), np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--stages", default="4,3")
    args = parser.parse_args()
    shapes = bg.Shapes(**expert_presets.PRESETS[args.preset].shape_flags())
    stages = [int(s) for s in args.stages.split(",")]
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  {args.preset} {shapes}")
    lines = []
    for tokens in map(int, args.tokens.split(",")):
        ids_np, routing_np = bg.route(tokens, shapes, 0.0, tokens)
        ids, routing = jnp.asarray(ids_np), jnp.asarray(routing_np)
        cases, outputs = {}, {}
        for dtype in (None, "float8_e4m3fn"):
            x, weights = bg.make_inputs(tokens, shapes, jnp.bfloat16, jax.random.key(tokens), dtype)
            call_args = (x, ids, routing, weights)
            for depth in stages:
                name = f"{'fp8' if dtype else 'bf16'} s{depth}"
                fn, outputs[name] = _compiled(call_args, depth)
                cases[name] = (fn, call_args)
        seconds = device_rates.time_fns_interleaved(
            list(cases.values()), warmup=2, iters=25 if tokens < 1000 else 10, reps=7
        )
        t = dict(zip(cases, seconds, strict=True))
        base = f"bf16 s{stages[0]}"
        for name, sec in t.items():
            family = name.split()[0]
            same = np.array_equal(outputs[name], outputs[f"{family} s{stages[0]}"])
            line = (
                f"| {tokens} | {name} | {sec * 1e3:.3f} | {t[base] / sec:.3f} "
                f"| {t[f'{family} s{stages[0]}'] / sec:.3f} | {same} |"
            )
            lines.append(line)
            print(line, flush=True)
        for name, (fn, call_args) in cases.items():
            ks = trace_calls.trace_kernels(functools.partial(fn, *call_args), 10)
            print(f"  {name}: {kernel_time.kernels_per_call(ks, 10, top=4)}", flush=True)
    print(f"| tokens | case | ms | {base} / case | same dtype s{stages[0]} / case | bit-equal |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
