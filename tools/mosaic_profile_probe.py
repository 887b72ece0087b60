"""Probe: where a Mosaic GPU expert kernel's compute warpgroups spend their time, on a GPU.

``PYTHONPATH=. python tools/mosaic_profile_probe.py [--preset qwen3-30b-a3b] [--tokens 4096]
[--expert-dtype float8_e4m3fn] [--spec default] [--profile-space 240] [--out DIR]``

Runs the grouped FFN (``grouped_gemm.grouped_ffn_rows``, ``impl="mosaic"``) once on the
routed rows of ``tools/fp8_layer_probe.py`` (capacity slots, Poisson counts around
``T * top_k / E``, capacity factor 4) and ``bench grouped_gemm``'s expert weights of the dtype,
with Mosaic GPU's in-kernel profiler on (``CompilerParams.profile_space`` / ``profile_dir``):
every CTA's warpgroups record the kernels' named scopes (``grouped_gemm_mosaic.SCOPE_*``) as
time ranges in SM clock cycles, up to ``--profile-space`` ranges per warpgroup (later ones
are dropped, so the record covers each CTA's first tiles). The profiler keeps its ranges in
shared memory, so the space must fit beside the kernel's own.

Prints, per kernel and per compute warpgroup, each scope's share of the warpgroup's recorded
span (first range's start to last range's end) and its median cycles per range; what no scope
covers is the time between them (the pipeline's barrier waits, the FP8 kernels' zeroing of
each fresh accumulator, loop overhead). The traces
(Perfetto JSON, one per kernel) are left in ``--out``.
"""

import argparse
import collections
import functools
import json
import pathlib
import statistics

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jtbo.bench import expert_presets
from jtbo.bench import grouped_gemm as bench_grouped_gemm
from jtbo.kernels import gemm_config, grouped_gemm
from tools import fp8_layer_probe


def _profiled_compiler_params(space: int, out: pathlib.Path) -> None:
    """Makes every Mosaic GPU ``CompilerParams`` of this process record ``space`` ranges per
    warpgroup into ``out`` (dropping the ones past it)."""
    params = plgpu.CompilerParams
    plgpu.CompilerParams = functools.partial(
        params, profile_space=space, profile_dir=str(out), profile_bounds_check=True
    )


def _ranges(trace: dict) -> dict[int, list[tuple[str, float, float]]]:
    """``{trace id: [(scope, start, end)]}``: each warpgroup's closed ranges, in clock
    cycles (the dump writes cycles / 1e3 as its microseconds)."""
    opened, ranges = collections.defaultdict(list), collections.defaultdict(list)
    for event in trace["traceEvents"]:
        tid, ts = event["tid"], event["ts"] * 1e3
        if event["ph"] == "B":
            opened[tid].append((event["name"], ts))
        else:
            name, start = opened[tid].pop()
            ranges[tid].append((name, start, ts))
    return ranges


def summarize(trace: dict, warpgroups: int = 3) -> list[str]:
    """Markdown rows ``| warpgroup | scope | share of span | median cycles | ranges |``: per
    compute warpgroup (trace id modulo ``warpgroups``), over every CTA's record."""
    span = collections.Counter()
    cycles = collections.defaultdict(list)
    for tid, ranges in _ranges(trace).items():
        warpgroup = (tid - 1) % warpgroups
        span[warpgroup] += max(end for *_, end in ranges) - min(start for _, start, _ in ranges)
        for name, start, end in ranges:
            cycles[warpgroup, name].append(end - start)
    rows, covered = [], collections.Counter()
    for (warpgroup, name), values in sorted(cycles.items()):
        covered[warpgroup] += sum(values)
        share = sum(values) / span[warpgroup]
        rows.append(f"| {warpgroup} | {name} | {share:.3f} | {statistics.median(values):.0f} | "
                    f"{len(values)} |")  # fmt: skip
    for warpgroup in sorted(span):  # the scopes do not nest: the rest lies between them
        rows.append(f"| {warpgroup} | (between scopes) | "
                    f"{1 - covered[warpgroup] / span[warpgroup]:.3f} | | |")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=expert_presets.PRESETS)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--expert-dtype", default="float8_e4m3fn",
                        choices=["bfloat16", "float8_e4m3fn"])  # fmt: skip
    parser.add_argument("--spec", default="default", help="bench grouped_gemm's mosaic:SPEC")
    parser.add_argument("--profile-space", type=int, default=240)
    parser.add_argument("--out", default="/tmp/mosaic-profile")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _profiled_compiler_params(args.profile_space, out)
    preset = expert_presets.PRESETS[args.preset]
    fp8 = args.expert_dtype == "float8_e4m3fn"
    rows_per_expert = args.tokens * preset.top_k / preset.experts  # as the layer's default
    default = gemm_config.default_mosaic_ffn(preset.hidden, preset.ffn, fp8, rows_per_expert)
    config = default if args.spec == "default" else bench_grouped_gemm.mosaic_config(args.spec)
    x, counts, rows = fp8_layer_probe.slots(
        args.tokens, preset.experts, preset.top_k, preset.hidden, seed=0
    )
    # The weights of the profiled dtype only, drawn a few experts at a time (DeepSeek-V3's
    # whole float32 draws do not fit an H100 beside the rest).
    shapes = bench_grouped_gemm.Shapes(**preset.shape_flags())
    _, weights = bench_grouped_gemm.make_inputs(
        1, shapes, jnp.bfloat16, jax.random.key(0), args.expert_dtype if fp8 else None
    )
    layer = functools.partial(
        grouped_gemm.grouped_ffn_rows, impl="mosaic", config=config, max_rows=rows
    )
    before = set(out.glob("*.json"))
    jax.block_until_ready(jax.jit(layer)(x, counts, *weights))
    jax.effects_barrier()  # the traces are written by a host callback after the kernels
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {args.preset}, "
          f"{args.expert_dtype}, {args.tokens} tokens ({rows} rows), spec {args.spec}, "
          f"{args.profile_space} ranges per warpgroup")  # fmt: skip
    for number, path in enumerate(sorted(set(out.glob("*.json")) - before)):
        kernel = ("gate / up", "down")[number] if number < 2 else path.name
        print(f"\n{kernel} kernel ({path.name})\n")
        print("| warpgroup | scope | share of span | median cycles | ranges |")
        print("|---|---|---|---|---|")
        print("\n".join(summarize(json.loads(path.read_text()))))


if __name__ == "__main__":
    main()
