"""Overlap report: does one micro-batch's communication run under the other's compute?

``overlap_report(step, abstract_args)`` compiles any jitted step for the devices its
abstract arguments' shardings name (an N x H200 host described to XLA from the CPU with
``jtbo.aot.gpu_mesh``), walks the compiled schedule (``hlo_schedule``) and measures

    coverage = bytes of collectives with >= 1 other-micro-batch compute instruction between
               start and done / bytes of all collectives

(a collective XLA left synchronous counts as not covered). Micro-batches are known from the
``tbo_a`` / ``tbo_b`` named scopes in the ``op_name`` metadata. A plain (non-TBO) step has
no micro-batches, so its coverage is 0 by definition; ``any_compute_coverage`` (any compute
in the window) is printed beside it.

``python -m jtbo.overlap.report`` does this for the toy DeepSeek-like stack
(``toy_stack``); see ``--help``. Findings on 8 x H200 compiles (jax 0.12, the toy stack,
``TBO_XLA_OPTIONS``) are printed by ``--help`` too (``FINDINGS``).
"""

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from jtbo.overlap import hlo_schedule, xla_options

FINDINGS = """\
Measured with this CLI (8 x H200 AOT compile on the CPU, jax 0.12, defaults: 3 layers,
hidden 1024, 32 experts, top-4, bf16, 2048 tokens/GPU prefill, 128 decode):
- with TBO_XLA_OPTIONS and round barriers (the default): coverage 1.000 for EP (all-to-all)
  and DP (all-gather / reduce-scatter), prefill and decode, DeepSeek and Qwen3 layouts;
  no TBO: 0.000 (no other micro-batch; 'any compute' 0.5, half the collectives synchronous).
- without barriers: EP prefill/decode 1.000, DP prefill 1.000, but DP decode 0.587 (XLA put
  only the issuing micro-batch's own gemm inside three reduce-scatters and one all-gather),
  Qwen3 decode 0.750 (first dispatch and last combine synchronous), Qwen3 prefill 0.917.
  Raising xla_gpu_experimental_parallel_collective_overlap_limit to 2 made it worse
  (DP decode 0.503, Qwen3 decode 0.667); 6 layers or 512 tokens/GPU gave 1.000. Round
  barriers (in-flight *_a results left out) pin every collective's window over the other
  micro-batch's stage and gave 1.000 everywhere.
- --default-xla-options --no-barriers on DP decode: 0.164 (the combiners merged A's and
  B's gathers: 6 collectives instead of 12).
"""


@dataclasses.dataclass(frozen=True)
class OverlapReport:
    """The collectives of one compiled step and how well they are hidden."""

    windows: tuple[hlo_schedule.CollectiveWindow, ...]  # every collective, schedule order
    compiler_options: dict[str, Any]  # the options the step was compiled with
    coverage: float  # covered bytes / all collective bytes (other micro-batch compute)
    any_compute_coverage: float  # same, counting any compute in the window
    hlo_text: str  # the compiled module


def coverage(windows: Sequence[hlo_schedule.CollectiveWindow], *, any_compute=False) -> float:
    """Fraction of collective bytes whose window holds (other-micro-batch) compute.

    Returns:
      A number in [0, 1]; 0 when there are no collective bytes.
    """
    total = sum(window.num_bytes for window in windows)
    covered = sum(
        window.num_bytes
        for window in windows
        if window.is_async
        and (window.between if any_compute else window.other_micro_batch_compute())
    )
    return covered / total if total else 0.0


def overlap_report(
    step: Callable[..., Any],
    abstract_args: Sequence[Any],
    *,
    compiler_options: dict[str, Any] | None = None,
) -> OverlapReport:
    """Compiles ``step`` for ``abstract_args`` and measures its overlap.

    Args:
      step: a ``jax.jit``-wrapped callable.
      abstract_args: ``jax.ShapeDtypeStruct``s (with shardings over the target mesh) or arrays.
      compiler_options: XLA options for the compile (e.g. ``xla_options.tbo_compiler_options()``).

    Returns:
      The report.
    """
    options = dict(compiler_options or {})
    compiled = step.lower(*abstract_args).compile(compiler_options=options or None)
    text = compiled.as_text()
    windows = tuple(hlo_schedule.collective_windows(text))
    return OverlapReport(
        windows=windows,
        compiler_options=options,
        coverage=coverage(windows),
        any_compute_coverage=coverage(windows, any_compute=True),
        hlo_text=text,
    )


def format_report(report: OverlapReport, *, title: str = "") -> str:
    """Renders the report: options, one line per collective, the coverages."""
    lines = [title] if title else []
    lines.append("compiler options: " + (_format_options(report.compiler_options) or "(none)"))
    for window in report.windows:
        other = window.other_micro_batch_compute()
        lines.append(
            f"  {window.kind:<15} {window.num_bytes:>12,d} B  by {window.micro_batch or '-':<6}"
            f" {'async' if window.is_async else 'SYNC '}  {window.start} .. {window.done}:"
            f" {len(window.between)} compute inside, {len(other)} of the other micro-batch"
            + (f" ({_summary(window.between)})" if window.between else "")
        )
    lines.append(
        f"coverage (other micro-batch) = {report.coverage:.3f}; "
        f"any compute = {report.any_compute_coverage:.3f}; "
        f"{len(report.windows)} collectives, {sum(not w.is_async for w in report.windows)} sync"
    )
    return "\n".join(lines)


def _format_options(options: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in sorted(options.items()))


def _summary(slots: Sequence[hlo_schedule.ComputeSlot]) -> str:
    shown = [f"{slot.name}[{slot.micro_batch or '-'}]" for slot in slots[:4]]
    return ", ".join(shown) + (f", +{len(slots) - 4} more" if len(slots) > 4 else "")


def draw_timeline(report: OverlapReport, path: str) -> None:
    """Draws the entry schedule: a compute lane per micro-batch and a lane of collectives."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    computations = hlo_schedule.parse_module(report.hlo_text)
    entry = next(c for c in computations.values() if c.is_entry)
    colors = {"tbo_a": "tab:blue", "tbo_b": "tab:orange"}
    figure, axes = pyplot.subplots(figsize=(14, 3))
    for index, instruction in enumerate(entry.instructions):
        if hlo_schedule.is_compute(instruction):
            batch = hlo_schedule.micro_batch_of(instruction, computations)
            lane = {"tbo_a": 2, "tbo_b": 1}.get(batch, 1.5)
            axes.barh(lane, 1, left=index, color=colors.get(batch, "grey"), height=0.4)
    for window in report.windows:
        if window.computation == entry.name:
            width = max(window.done_index - window.start_index, 0.5)
            color = colors.get(window.micro_batch, "grey")
            axes.barh(0, width, left=window.start_index, color=color, height=0.4, alpha=0.6)
    axes.set_yticks([0, 1, 1.5, 2], ["collectives", "B compute", "other", "A compute"])
    axes.set_xlabel("position in the compiled schedule")
    axes.set_title(f"coverage {report.coverage:.3f}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def toy_report(
    args: argparse.Namespace,
) -> OverlapReport:
    """Compiles the toy stack described by the parsed CLI ``args`` and reports it."""
    from jtbo import aot
    from jtbo.collectives import mesh as mesh_lib
    from jtbo.overlap import toy_stack

    config = toy_stack.ToyStackConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        top_k=args.top_k,
        moe=args.moe,
        shared_experts=args.shared_experts,
        dtype=jnp.dtype(args.dtype),
    )
    mode = toy_stack.strategy.ForwardMode[{"prefill": "EXTEND", "decode": "DECODE"}[args.mode]]
    options = toy_stack.ToyStepOptions(
        forward_mode=mode, enable_tbo=args.tbo, barriers=args.barriers
    )
    mesh = aot.gpu_mesh((args.num_devices, 1), (mesh_lib.DP_AXIS, mesh_lib.ATTN_TP_AXIS))
    step = toy_stack.make_step(mesh, config, options)
    abstract = toy_stack.abstract_step_args(mesh, config, tokens_per_rank=args.tokens)
    overrides = dict(xla_options.parse_option(text) for text in args.xla_option)
    compiler_options = xla_options.tbo_compiler_options(overrides=overrides)
    if args.default_xla_options:
        compiler_options = overrides
    return overlap_report(step, abstract, compiler_options=compiler_options)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jtbo.overlap.report",
        description="Overlap coverage of the toy DeepSeek-like stack on an N x H200 compile.",
        epilog=FINDINGS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flag = argparse.BooleanOptionalAction
    parser.add_argument("--mode", choices=("prefill", "decode"), default="prefill")
    parser.add_argument("--tbo", action=flag, default=True, help="two overlapped micro-batches")
    parser.add_argument("--barriers", action=flag, default=True, help="round barriers")
    parser.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--default-xla-options",
        action="store_true",
        help="compile without TBO_XLA_OPTIONS (only --xla-option ones)",
    )
    parser.add_argument("--moe", choices=("ep", "dp"), default="ep", help="EP all-to-all or DP")
    parser.add_argument("--shared-experts", action=flag, default=True)
    parser.add_argument("--num-devices", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per GPU")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dump-hlo", metavar="PATH")
    parser.add_argument("--png", metavar="PATH")
    return parser


def main(argv: Sequence[str]) -> OverlapReport:
    """CLI entry: compiles, prints the report, writes ``--dump-hlo`` / ``--png`` if asked."""
    args = _parser().parse_args(list(argv))
    if args.tokens is None:
        args.tokens = 2048 if args.mode == "prefill" else 128
    report = toy_report(args)
    title = (
        f"toy stack: mode={args.mode} tbo={args.tbo} barriers={args.barriers} moe={args.moe} "
        f"devices={args.num_devices} tokens/GPU={args.tokens} layers={args.layers} "
        f"hidden={args.hidden} experts={args.experts} top_k={args.top_k} dtype={args.dtype}"
    )
    print(format_report(report, title=title))
    if args.dump_hlo:
        with open(args.dump_hlo, "w") as handle:
            handle.write(report.hlo_text)
    if args.png:
        draw_timeline(report, args.png)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
