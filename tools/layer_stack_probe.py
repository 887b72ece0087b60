"""Probe: the expert layer timed one layer per call (as ``bench grouped_gemm`` times it)
against a stack of layers in one call, each with its own routing and weights, the output of
one the input of the next (as a model step runs its layers); the layer as the model calls it
(``experts_capacity``, capacity = T, ``"auto"``), timed in turns in one process. The per-call
cost of a jitted call (its launch and the gap before its first kernel) is paid once per layer
in the first, once per stack in the second. Prints ms per layer and the weight bytes per
second over the copy ceiling; a markdown table last.

``PYTHONPATH=. python tools/layer_stack_probe.py [--tokens 64,128,256] [--dtypes fp8,bf16]
[--layers 8]`` (a GPU)
"""

import argparse
import contextlib
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import device_rates, expert_presets, kernel_time, trace_calls
from jtbo.bench import grouped_gemm as bg
from jtbo.models import experts

layer = functools.partial(experts.experts_capacity, impl="auto")


def stack(x, layer_ids, layer_routing, layer_weights):
    """The layers one after the other, each with its own routing and weights, each adding its
    output to the residual rows as a model's layer does (without it the rows shrink about
    quadratically a layer, SwiGLU of small values, and are zero within a few layers)."""
    for topk_ids, topk_weights, weights in zip(
        layer_ids, layer_routing, layer_weights, strict=True
    ):
        x = x + layer(x, topk_ids, topk_weights, weights)
    return x


def setup(doc: str, dtypes: bool = True):
    """``(args, shapes, copy GB/s)``: the probes' flags parsed, the preset's expert shape, the
    copy ceiling measured; prints the device line."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--tokens", default="64,128,256")
    if dtypes:
        parser.add_argument("--dtypes", default="fp8,bf16")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    args = parser.parse_args()
    shapes = bg.Shapes(**expert_presets.PRESETS[args.preset].shape_flags())
    copy_gbs, _ = device_rates.copy_gbs(1 << 30, iters=20, reps=5)
    device = jax.devices()[0].device_kind
    print(f"device {device}  jax {jax.__version__}  {shapes}  copy {copy_gbs:.0f} GB/s")
    return args, shapes, copy_gbs


def layer_weights_of(shapes, layers: int, dtype: str) -> list:
    """Each layer's expert weights, bf16 or FP8 (``dtype`` "fp8")."""
    expert_dtype = "float8_e4m3fn" if dtype == "fp8" else None
    keys = jax.random.split(jax.random.key(3), layers)
    return [bg.make_inputs(1, shapes, jnp.bfloat16, k, expert_dtype)[1] for k in keys]


def stack_args(shapes, tokens: int, layer_weights: list) -> tuple:
    """``stack``'s arguments: random tokens, each layer its own random routing."""
    routes = [bg.route(tokens, shapes, 0.0, tokens + i) for i in range(len(layer_weights))]
    x = jax.random.normal(jax.random.key(tokens), (tokens, shapes.hidden), jnp.bfloat16)
    layer_ids = [jnp.asarray(ids) for ids, _ in routes]
    return x, layer_ids, [jnp.asarray(routing) for _, routing in routes], layer_weights


def weight_gb(shapes, layer_ids: list, dtype: str) -> float:
    """GB of the routed experts' weights a layer reads (the experts hit, averaged)."""
    experts_hit = np.mean([len(np.unique(np.asarray(ids))) for ids in layer_ids])
    return shapes.weight_bytes(experts_hit, 1 if dtype == "fp8" else 2) / 1e9


def compiled(body, args, patches=()):
    """``(fn, its output as float32)``: ``body`` jitted as a step, traced and compiled now with
    ``patches`` (``(module, name, value)``) in place. Each call jits a function of its own:
    jax's trace cache is keyed by the function, and a patched trace must not serve another."""
    fn = bg.jit_as_step(lambda *a: body(*a))
    with contextlib.ExitStack() as patched:
        for module, name, value in patches:
            patched.enter_context(mock.patch.object(module, name, value))
        out = np.asarray(fn(*args), np.float32)
    return fn, out


def per_layer_cells(seconds_per_layer, gbytes: float, copy_gbs: float, digits: int = 3):
    """``"ms (of copy)"`` of each time per layer: milliseconds, and the layer's weight bytes
    per second over the copy ceiling."""
    return [
        f"{t * 1e3:.{digits}f} ({gbytes / t / copy_gbs:.{digits - 1}f})" for t in seconds_per_layer
    ]


def print_table(header: str, rows: list[str]) -> None:
    """A markdown table: ``header`` (``| a | b |``), its rule, then ``rows``."""
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    print("\n".join(rows))


def main() -> None:
    args, shapes, copy_gbs = setup(__doc__)
    rows = []
    for dtype in args.dtypes.split(","):
        layer_weights = layer_weights_of(shapes, args.layers, dtype)
        for tokens in map(int, args.tokens.split(",")):
            x, layer_ids, layer_routing, _ = stack_args(shapes, tokens, layer_weights)
            ids, routing = layer_ids[0], layer_routing[0]
            one = bg.jit_as_step(layer)
            many = bg.jit_as_step(stack)
            cases = [
                (one, (x, ids, routing, layer_weights[0])),
                (many, (x, layer_ids, layer_routing, layer_weights)),
            ]
            seconds = device_rates.time_fns_interleaved(cases, warmup=2, iters=20, reps=7)
            per_layer = [seconds[0], seconds[1] / args.layers]
            gbytes = weight_gb(shapes, layer_ids[:1], dtype)
            ks = trace_calls.trace_kernels(functools.partial(many, *cases[1][1]), 5)
            timed = per_layer_cells(per_layer, gbytes, copy_gbs)
            line = (
                f"| {dtype} | {tokens} | {' | '.join(timed)} | {per_layer[0] / per_layer[1]:.3f} |"
            )
            rows.append(line)
            print(line, flush=True)
            print(
                f"  stack: {kernel_time.kernels_per_call(ks, 5 * args.layers, top=4)}", flush=True
            )
    print_table(
        f"| experts | tokens | one layer a call: ms (of copy) | {args.layers} layers a call: "
        "ms per layer (of copy) | one / stack |",
        rows,
    )


if __name__ == "__main__":
    main()
