"""Probe: how long one model step program takes to lower and to compile for a described H200
(``jtbo.aot``, on the CPU), at a published model's dimensions and a given number of layers.

The step is the runner's (``jtbo.analysis.aot_report.model_step_program``) with the grouped
GEMM kernels of ``--backend`` compiled for the GPU, not interpreted: the probe reports the
kernels as available (the CPU has no Hopper GPU) and sizes the Mosaic GPU kernels' persistent
grid for the H200's 132 SMs. Lowering is the host's Python work (tracing done, jaxpr to
StableHLO, the Pallas kernels to Triton / Mosaic GPU), the same on a GPU machine; the compile
is XLA's for the described GPU with its GEMM autotuner off (``--xla_gpu_autotune_level=0``
in ``XLA_FLAGS``; a GPU machine times candidates instead).

``XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=. python tools/step_lowering_probe.py
--layers 2,48 [--backend mosaic] [--mode EXTEND] [--tbo] [--expert-dtype float8_e4m3fn]``
(needs the ``aot`` extra)
"""

import argparse
import dataclasses
import pathlib
import time

from jtbo.analysis import aot_report
from jtbo.bench import hf_configs
from jtbo.kernels import grouped_gemm_mosaic, impls
from jtbo.models import layer_ops
from jtbo.split.forward_mode import ForwardMode

H200_SMS = 132


def _as_on_an_h200() -> None:
    """Kernels compiled for the GPU: available, not interpreted, a grid of the H200's SMs."""
    impls.backend = lambda: "gpu"
    impls.unavailable_reason = lambda impl, platform: None
    grouped_gemm_mosaic.num_clusters = lambda interpret: H200_SMS // 2


def _program(args, num_layers: int):
    raw = hf_configs.read_layers(pathlib.Path(args.hf_config), num_layers)
    config = dataclasses.replace(hf_configs.moe_config(raw), expert_dtype=args.expert_dtype)
    mode = ForwardMode[args.mode]
    decode = mode == ForwardMode.DECODE
    return aot_report.model_step_program(
        config, aot_report.h200_mesh(1, 1), mode=mode, enable_tbo=args.tbo,
        tokens_per_rank=args.decode_tokens if decode else args.prefill_tokens,
        seq_capacity=args.decode_tokens if decode else 4,
        moe=layer_ops.MoEOptions(moe_runner_backend=args.backend),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-config", default="tools/hf_configs/qwen3_30b_a3b.json")
    parser.add_argument("--layers", default="2,48", help="comma-separated layer counts")
    parser.add_argument("--backend", default="mosaic", help="MoEOptions.moe_runner_backend")
    parser.add_argument("--mode", default="EXTEND", choices=["EXTEND", "DECODE"])
    parser.add_argument("--tbo", action="store_true", help="the two-batch-overlap step")
    parser.add_argument("--expert-dtype", default=None, help="e.g. float8_e4m3fn")
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--decode-tokens", type=int, default=128)
    args = parser.parse_args()
    _as_on_an_h200()
    rows = []
    for num_layers in (int(n) for n in args.layers.split(",")):
        jitted, abstract_args, options = _program(args, num_layers)
        start = time.perf_counter()
        lowered = jitted.lower(*abstract_args)
        lowered_at = time.perf_counter()
        lowered.compile(compiler_options=options)
        rows.append((num_layers, lowered_at - start, time.perf_counter() - lowered_at))
    label = f"{args.backend} {args.mode}{' TBO' if args.tbo else ''} {args.expert_dtype or ''}"
    print(f"| layers | lower s | compile s |  ({label.strip()})\n|---|---|---|")
    for num_layers, lower_s, compile_s in rows:
        print(f"| {num_layers} | {lower_s:.2f} | {compile_s:.2f} |")


if __name__ == "__main__":
    main()
