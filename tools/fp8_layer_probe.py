"""Probe: the grouped FFN kernels alone at prefill sizes, bf16 against FP8, timed in turns.

``PYTHONPATH=. python tools/fp8_layer_probe.py [--tokens 4096,16384] [--small]``

For each token count T: routed rows ``T * top_k`` spread over the experts (counts drawn
around their mean), laid out in capacity slots (capacity factor 4) as ``experts_capacity``
lays them, then ``grouped_ffn_rows`` of each case on the same slots, timed interleaved
(``device_rates.time_fns_interleaved``): a dense bf16 SwiGLU over the same number of rows
through one expert's weights (the yardstick), the bf16 Pallas and Mosaic kernels, the FP8
Mosaic kernels, and the FP8 Pallas ones (``--pallas-fp8-max`` tokens and below). The FP8
weights are the bf16 ones quantized in 128 x 128 blocks. Prints a table: ms, TFLOP/s of the
useful FLOPs, and each case against dense and against bf16 Mosaic; the FP8 Mosaic result's
error against the FP8 Pallas one.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import device_rates
from jtbo.bench import grouped_gemm as bench_grouped_gemm
from jtbo.kernels import fp8_blocks, grouped_gemm


def weights(experts: int, hidden: int, ffn: int):
    """``((w_gate_up, w_down) in bf16, the same quantized in 128 x 128 FP8 blocks)``: random
    expert weights."""
    k1, k2 = jax.random.split(jax.random.key(0))
    w_gate_up = (jax.random.normal(k1, (experts, hidden, 2, ffn)) / hidden**0.5).astype(
        jnp.bfloat16
    )
    w_down = (jax.random.normal(k2, (experts, ffn, hidden)) / ffn**0.5).astype(jnp.bfloat16)
    quantized = [fp8_blocks.quantize_experts(w, (128, 128)) for w in (w_gate_up, w_down)]
    return (w_gate_up, w_down), tuple(quantized)


def slots(tokens: int, experts: int, top_k: int, hidden: int, seed: int):
    """``(x_slots [E, 4 * mean, H], counts [E], routed rows)``: random rows in capacity slots,
    Poisson counts around their mean ``tokens * top_k / experts``."""
    rng = np.random.default_rng(seed)
    mean = tokens * top_k // experts
    capacity = 4 * mean
    counts = np.clip(rng.poisson(mean, experts), 0, capacity).astype(np.int32)
    x = jax.random.normal(jax.random.key(seed), (experts, capacity, hidden), jnp.bfloat16)
    return x, jnp.asarray(counts), int(counts.sum())


def _first(weights):
    """The first expert's ``(w_gate_up, w_down)``."""
    return weights[0][0], weights[1][0]


def result(fn, args) -> np.ndarray:
    """``fn(*args)`` as a float32 ``[E, C, H]`` array (``SlotRows`` materialized)."""
    out = fn(*args)
    return np.asarray(out.materialize() if hasattr(out, "materialize") else out, np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="4096,16384")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--pallas-fp8-max", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    bf16, fp8 = weights(args.experts, args.hidden, args.ffn)
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}  E={args.experts} "
          f"H={args.hidden} F={args.ffn} top-{args.top_k}")  # fmt: skip
    print("| tokens | case | ms | TFLOP/s | of dense | vs bf16 mosaic |")
    print("|---|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        x, counts, rows = slots(tokens, args.experts, args.top_k, args.hidden, tokens)
        rows_fn = functools.partial(grouped_gemm.grouped_ffn_rows, max_rows=rows)
        dense = jax.jit(bench_grouped_gemm.dense_layer)
        cases = {
            "dense bf16": (dense, (x.reshape(-1, args.hidden)[:rows], *_first(bf16))),
            "pallas bf16": (jax.jit(functools.partial(rows_fn, impl="pallas")), (x, counts, *bf16)),
            "mosaic bf16": (jax.jit(functools.partial(rows_fn, impl="mosaic")), (x, counts, *bf16)),
            "mosaic fp8": (jax.jit(functools.partial(rows_fn, impl="mosaic")), (x, counts, *fp8)),
        }  # fmt: skip
        if tokens <= args.pallas_fp8_max:
            cases["pallas fp8"] = (
                jax.jit(functools.partial(rows_fn, impl="pallas")),
                (x, counts, *fp8),
            )
        seconds = device_rates.time_fns_interleaved(
            list(cases.values()), warmup=2, iters=5, reps=args.reps
        )
        flops = 6 * rows * args.hidden * args.ffn
        times = dict(zip(cases, seconds, strict=True))
        for name, t in times.items():
            print(f"| {tokens} | {name} | {t * 1e3:.3f} | {flops / t / 1e12:.0f} | "
                  f"{times['dense bf16'] / t:.2f} | {times['mosaic bf16'] / t:.2f} |")  # fmt: skip
        if "pallas fp8" in cases:
            got = [result(*cases[name]) for name in ("mosaic fp8", "pallas fp8")]
            live = np.arange(x.shape[1])[None, :] < np.asarray(counts)[:, None]
            diff = np.linalg.norm(got[0][live] - got[1][live]) / np.linalg.norm(got[1][live])
            print(f"mosaic fp8 vs pallas fp8 at {tokens}: rel diff {diff:.2e}")


if __name__ == "__main__":
    main()
