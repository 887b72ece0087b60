"""``python -m jtbo.analysis.report_cli``: the overlap report of the model's own step.

Compiles the program ``ModelRunner`` serves (``aot_report.model_step_program``) for an N x H200
host described from the CPU and prints ``report.format_report`` of it: ``--model NAME`` names a
``MoEConfig`` constructor, otherwise the size flags (``--layers``, ``--hidden``, ``--experts``
...) describe a DeepSeek-like stack (``flag_config``); see ``--help``.
"""

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from jtbo.analysis import aot_report, report, schedule_costs
from jtbo.models import config as config_lib
from jtbo.models import layer_ops
from jtbo.overlap import xla_options

_FORWARD_MODES = {"prefill": "EXTEND", "decode": "DECODE"}
_MODEL_BACKENDS = {"ep": "ep", "dp": "none"}  # the CLI's --moe -> the model's moe_a2a_backend
MODELS = ("tiny", "tiny_softmax", "deepseek_v3_reduced", "deepseek_v3_gqa_reduced")  # presets


def _compiler_options(args: argparse.Namespace, defaults: Callable[..., dict]) -> dict[str, Any]:
    """The program's own options with ``--xla-option`` on top (only those: ``--default-...``)."""
    overrides = dict(xla_options.parse_option(text) for text in args.xla_option)
    if args.default_xla_options:
        return overrides
    return defaults(overrides=overrides)


def flag_config(args: argparse.Namespace):
    """The ``MoEConfig`` the size flags describe: every layer MoE, DeepSeek-like routing.

    Attention has heads of 128 (one head below a hidden size of 128), as many KV heads as
    query heads; the shared expert (``--shared-experts``) and the routed experts share
    ``--intermediate``; routing is plain sigmoid top-k (one expert group).
    """
    heads = max(args.hidden // 128, 1)
    return config_lib.MoEConfig(
        vocab_size=1024, hidden_size=args.hidden, num_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=args.hidden // heads,
        first_k_dense=0, intermediate_size=args.intermediate, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.intermediate,
        num_shared_experts=1 if args.shared_experts else 0, n_group=1, topk_group=1,
    )  # fmt: skip


def model_report(
    args: argparse.Namespace,
    cost_model: schedule_costs.CostModel = report.DEFAULT_COST_MODEL,
    large_bytes: int = report.LARGE_BYTES,
) -> report.OverlapReport:
    """Compiles the model's own step (``aot_report.model_step_program``) and reports it.

    Args:
      args: the parsed CLI flags (``_parser``); ``--model`` names a ``MoEConfig`` constructor
        (without it, ``flag_config``), the mesh is ``num_devices / attn_tp`` DP ranks of
        ``attn_tp`` devices.
      cost_model: device and link figures the windows are priced with.
      large_bytes: the size threshold of ``FillSummary.min_fill``.

    Returns:
      The report.

    Raises:
      ValueError: ``--num-devices`` is not a multiple of ``--attn-tp``, or the plan cannot run
        TBO although asked to.
    """
    if args.num_devices % args.attn_tp:
        raise ValueError(f"--num-devices {args.num_devices} is not a multiple of --attn-tp")
    config = getattr(config_lib.MoEConfig, args.model)() if args.model else flag_config(args)
    mesh = aot_report.h200_mesh(args.num_devices // args.attn_tp, args.attn_tp)
    step, abstract, step_options = aot_report.model_step_program(
        config, mesh,
        mode=aot_report.ForwardMode[_FORWARD_MODES[args.mode]], tokens_per_rank=args.tokens,
        enable_tbo=args.tbo, dtype=jnp.dtype(args.dtype), tbo_round_barriers=args.barriers,
        moe=layer_ops.MoEOptions(
            moe_a2a_backend=_MODEL_BACKENDS[args.moe], ep_capacity_factor=args.ep_capacity_factor,
            ep_dedup=args.ep_dedup,
        ),
    )  # fmt: skip
    compiler_options = _compiler_options(
        args, lambda overrides: {**(step_options or {}), **overrides}
    )
    return report.overlap_report(
        step, abstract, compiler_options=compiler_options, cost_model=cost_model,
        large_bytes=large_bytes,
    )  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jtbo.analysis.report",
        description="Overlap coverage and window fill of the model's own step on an N x H200 "
        "compile: a MoEConfig constructor (--model) or the stack the size flags describe.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flag = argparse.BooleanOptionalAction
    parser.add_argument("--mode", choices=("prefill", "decode"), default="prefill")
    parser.add_argument("--tbo", action=flag, default=True, help="two overlapped micro-batches")
    parser.add_argument(
        "--barriers", action=flag, default=False,
        help="round barriers (ParallelConfig.tbo_round_barriers; off as in ModelRunner)",
    )  # fmt: skip
    parser.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--default-xla-options",
        action="store_true",
        help="compile without the program's own options (only --xla-option ones)",
    )
    parser.add_argument("--moe", choices=("ep", "dp"), default="ep", help="EP all-to-all or DP")
    parser.add_argument("--num-devices", "--devices", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per GPU (per DP rank)")
    _add_pricing_flags(parser)
    _add_model_flags(parser)
    _add_size_flags(parser)
    parser.add_argument("--dump-hlo", metavar="PATH")
    parser.add_argument("--png", metavar="PATH")
    return parser


def _add_pricing_flags(parser: argparse.ArgumentParser) -> None:
    default = report.DEFAULT_COST_MODEL
    parser.add_argument(
        "--link-gbps", type=float, default=default.link_bytes_per_s / 1e9, metavar="G",
        help="collective bytes per second through NCCL, in GB/s, that exchanges are priced "
        "with (default: NVLink between two H200s; e.g. 40 for NCCL through host memory)",
    )  # fmt: skip
    parser.add_argument(
        "--large-mib", type=float, default=report.LARGE_BYTES / (1 << 20),
        help="the minimum fill is taken over collectives of at least this many MiB",
    )  # fmt: skip


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", choices=MODELS, default=None,
        help="this MoEConfig constructor instead of the size flags",
    )  # fmt: skip
    parser.add_argument("--attn-tp", type=int, default=1, help="devices per DP rank")
    parser.add_argument(
        "--ep-capacity-factor", type=float, default=None,
        help="EP capacity factor (default: worst case)",
    )  # fmt: skip
    parser.add_argument(
        "--ep-dedup", action=argparse.BooleanOptionalAction, default=True,
        help="one EP row per (token, destination GPU) (the default); --no-ep-dedup: one per "
        "(token, expert)",
    )  # fmt: skip


def _add_size_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shared-experts", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", help="parameter / activation dtype")


def _title(args: argparse.Namespace) -> str:
    name = args.model or (
        f"of the size flags (layers={args.layers} hidden={args.hidden} experts={args.experts} "
        f"top_k={args.top_k})"
    )
    return (
        f"model step {name}: mode={args.mode} tbo={args.tbo} barriers={args.barriers} "
        f"moe={args.moe} devices={args.num_devices} (dp={args.num_devices // args.attn_tp} x "
        f"attn_tp={args.attn_tp}) tokens/DP rank={args.tokens} "
        f"ep_capacity_factor={args.ep_capacity_factor} ep_dedup={args.ep_dedup} "
        f"dtype={args.dtype}"
    )


def main(argv: Sequence[str]) -> report.OverlapReport:
    """CLI entry: compiles, prints the report, writes ``--dump-hlo`` / ``--png`` if asked.

    Args:
      argv: the flags (``--help`` lists them).

    Returns:
      The report.

    Raises:
      ValueError: see ``model_report``.
    """
    args = _parser().parse_args(list(argv))
    if args.tokens is None:
        args.tokens = 2048 if args.mode == "prefill" else 128
    cost_model = schedule_costs.CostModel(link_bytes_per_s=args.link_gbps * 1e9)
    result = model_report(args, cost_model, large_bytes=int(args.large_mib * (1 << 20)))
    print(report.format_report(result, title=_title(args)))
    if args.dump_hlo:
        with open(args.dump_hlo, "w") as handle:
            handle.write(result.hlo_text)
    if args.png:
        report.draw_timeline(result, args.png)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
