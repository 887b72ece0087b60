"""The TBO step model from the command line: ``python -m jtbo.bench predict [flags]``.

``python -m jtbo.bench predict --model NAME --ep N --mode prefill|decode --tokens-per-gpu T
--link-gbps B [--link-latency-us L] [--prompt-len P] [--context C] [--imbalance X |
--routing-stats FILE] [--host-ms H] [--table FILE] [--expert-dtype bfloat16|float8_e4m3fn]
[stack flags] [--json] [--plot FILE]`` predicts one GPU's plain and TBO step
(``jtbo.analysis.step_model``) from a cost table (the shipped H200 table by default) on the
CPU, and prints the model's weight bytes on one GPU of the EP group
(``jtbo.models.param_bytes``: bf16, the routed experts in ``--expert-dtype``). ``--json``
prints one JSON object (``plain_ms``, ``tbo_ms``, ``gain``, ``per_operation``, ``traffic``,
``weight_bytes_per_gpu`` ...) after the summary line; ``--plot FILE`` writes a PNG of the
predicted TBO gain against tokens per GPU at EP 8, 32 and 72 (matplotlib, the ``test``
extra). ``--host-ms`` replaces the table's host time per step, plain and TBO (by default the
table's runner host time of the mode where it has one, else its host round trip).

The stack flags (``StackFlags``) say which serving stack is priced: ``--stack jtbo|sglang``
names one (``step_model.serving_stack``: its exchange, decode attention and exchange engine
for the mode), and ``--dispatch-dtype``, ``--combine-dtype``, ``--topology``,
``--gpus-per-node``, ``--nvlink-gbps``, ``--decode-attention``, ``--attention-gbps``,
``--link-engine``, ``--expert-gemm-dtype`` and ``--fp8-speedup`` each replace that part of it.
A flat topology has no NVLink leg, the measured attention no rate and bf16 expert GEMMs no FP8
speedup, so a stack's node fields, rate or speedup are dropped when a flag picks those, and
giving them as flags too is an error.

``python -m jtbo.bench predict --measure --out FILE [--small] [--sections A,B]`` measures a
new table on the device instead (``jtbo.bench.step_costs_measure``), writing it after every
section; ``--sections`` measures only the named sections into the table already at ``FILE``
(the others kept as they are).
"""

import argparse
import dataclasses
import json
import os
from typing import Any

from jtbo.analysis import step_costs, step_exchange, step_model, step_ops
from jtbo.bench import options
from jtbo.core import cli_arguments
from jtbo.models import config as config_lib
from jtbo.models import param_bytes

MODELS = {
    "deepseek_v3": config_lib.MoEConfig.deepseek_v3,
    "deepseek_v3_reduced": config_lib.MoEConfig.deepseek_v3_reduced,
    "deepseek_v3_gqa_reduced": config_lib.MoEConfig.deepseek_v3_gqa_reduced,
    "tiny": config_lib.MoEConfig.tiny,
}
EXPERT_DTYPES = ("bfloat16", "float8_e4m3fn")
"""``--expert-dtype``: bf16 routed experts, or block-scaled FP8 (``MoEConfig.expert_dtype``)."""
PLOT_EP = (8, 32, 72)
PLOT_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _positive_float(text: str) -> float:
    value = cli_arguments.non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


_STACK_DEFAULT = "(default: the stack's)"


@dataclasses.dataclass(frozen=True)
class StackFlags:
    """The serving stack's flags: a named stack and, for each of its parts, a flag that
    replaces it (None: the stack's)."""

    stack: str = options.option(
        "jtbo", choices=step_model.STACKS,
        help="serving stack priced: jtbo (its own) or sglang (DeepEP, FP8 dispatch, a "
        "memory-bound MLA decode kernel, FP8 expert GEMMs)",
    )  # fmt: skip
    dispatch_dtype: str | None = options.option(
        None, choices=step_exchange.ROW_DTYPES, help=f"dispatched rows {_STACK_DEFAULT}"
    )
    combine_dtype: str | None = options.option(
        None, choices=step_exchange.ROW_DTYPES, help=f"combined rows {_STACK_DEFAULT}"
    )
    topology: str | None = options.option(
        None, choices=step_exchange.TOPOLOGIES,
        help="flat: a row per destination GPU over the link; node: a row per destination "
        "node over the link, forwarded over NVLink inside it; pairs: a message per (token, "
        f"expert) pair {_STACK_DEFAULT}",
    )  # fmt: skip
    gpus_per_node: int | None = options.option(
        None, type=cli_arguments.positive_int, help=f"node / pairs {_STACK_DEFAULT}"
    )
    nvlink_gbps: float | None = options.option(
        None, type=_positive_float, help=f"GB/s a GPU sends over NVLink {_STACK_DEFAULT}"
    )
    decode_attention: str | None = options.option(
        None, choices=step_ops.ATTENTION_PRICES,
        help="measured: the table's kernel; roofline: the KV cache's bytes / --attention-gbps "
        f"{_STACK_DEFAULT}",
    )  # fmt: skip
    attention_gbps: float | None = options.option(
        None, type=_positive_float, help=f"roofline KV read rate, GB/s {_STACK_DEFAULT}"
    )
    link_engine: str | None = options.option(
        None, choices=("sm", "copy"), help=f"what moves the exchange's bytes {_STACK_DEFAULT}"
    )
    expert_gemm_dtype: str | None = options.option(
        None, choices=step_ops.EXPERT_GEMM_DTYPES,
        help=f"routed experts' GEMMs: bf16 (the table's) or fp8 (priced from it) {_STACK_DEFAULT}",
    )  # fmt: skip
    fp8_speedup: float | None = options.option(
        None, type=_positive_float,
        help=f"fp8 expert GEMMs: the FP8 rate over the bf16 rate {_STACK_DEFAULT}",
    )  # fmt: skip


def resolve_stack(flags: StackFlags, mode: str) -> step_model.Stack:
    """The stack the flags ask for in ``mode``: the named stack, each part a flag gives
    replaced (module docstring).

    Args:
      flags: the parsed stack flags.
      mode: "prefill" or "decode".

    Returns:
      The stack.

    Raises:
      ValueError: an inconsistent stack (``step_exchange.Exchange`` and ``DecodeAttention`` say
        which).
    """
    base = step_model.serving_stack(flags.stack, mode)
    return step_model.Stack(
        _exchange(base.exchange, flags),
        _decode_attention(base.decode_attention, flags),
        flags.link_engine or base.engine,
        _expert_gemm(base.expert_gemm, flags),
    )


def _given(flag: Any, base: Any, keep: bool) -> Any:
    """A flag's value, else the base's when it still applies (``keep``), else None."""
    return flag if flag is not None else base if keep else None


def _exchange(base: step_exchange.Exchange, flags: StackFlags) -> step_exchange.Exchange:
    topology = flags.topology or base.topology
    keep = topology != "flat"
    return step_exchange.Exchange(
        flags.dispatch_dtype or base.dispatch_dtype,
        flags.combine_dtype or base.combine_dtype,
        topology,
        _given(flags.gpus_per_node, base.gpus_per_node, keep),
        _given(flags.nvlink_gbps, base.nvlink_gbps, keep),
    )


def _decode_attention(
    base: step_ops.DecodeAttention, flags: StackFlags
) -> step_ops.DecodeAttention:
    price = flags.decode_attention or base.price
    gbps = _given(flags.attention_gbps, base.gbps, keep=price == "roofline")
    return step_ops.DecodeAttention(price, gbps)


def _expert_gemm(base: step_ops.ExpertGemm, flags: StackFlags) -> step_ops.ExpertGemm:
    dtype = flags.expert_gemm_dtype or base.dtype
    speedup = _given(flags.fp8_speedup, base.fp8_speedup, keep=dtype == "fp8")
    return step_ops.ExpertGemm(dtype, speedup)


def describe_stack(name: str, stack: step_model.Stack) -> str:
    """One line naming what the stack prices."""
    ex, attention = stack.exchange, stack.decode_attention
    where = (
        f", {ex.gpus_per_node} GPUs per node, NVLink {ex.nvlink_gbps:g} GB/s"
        if ex.topology != "flat"
        else ""
    )
    rate = f" at {attention.gbps:g} GB/s" if attention.price == "roofline" else ""
    gemm = stack.expert_gemm
    speedup = f" at {gemm.fp8_speedup:g}x the bf16 rate" if gemm.dtype == "fp8" else ""
    return (
        f"stack {name}: dispatch {ex.dispatch_dtype}, combine {ex.combine_dtype}, "
        f"{ex.topology} exchange{where}, moved by {stack.engine}; decode attention "
        f"{attention.price}{rate}; expert GEMMs {gemm.dtype}{speedup}"
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = cli_arguments.OneLineErrorParser(prog="python -m jtbo.bench predict")
    add = parser.add_argument
    add("--model", choices=sorted(MODELS), default="deepseek_v3")
    add("--expert-dtype", choices=EXPERT_DTYPES, default="bfloat16",
        help="routed experts' weights in the weight bytes per GPU (the rest: bf16)")  # fmt: skip
    add("--ep", type=cli_arguments.positive_int, default=32, help="EP size (GPUs)")
    add("--mode", choices=("prefill", "decode"), default="prefill")
    add("--tokens-per-gpu", type=cli_arguments.positive_int, default=16384)
    add("--link-gbps", type=_positive_float, default=50.0, help="GB/s a GPU sends")
    add("--link-latency-us", type=cli_arguments.non_negative_float, default=0.0)
    add("--prompt-len", type=cli_arguments.positive_int, default=4096)
    add("--context", type=cli_arguments.positive_int, default=2048, help="decode KV length")
    add("--imbalance", type=_positive_float, default=1.0, help="hottest GPU load / mean")
    add("--host-ms", type=cli_arguments.non_negative_float,
        help="host time per step, ms (default: the cost table's, per mode)")  # fmt: skip
    add("--routing-stats", type=cli_arguments.existing_file, help="ep_routing_stats file")
    add("--table", type=cli_arguments.existing_file, help="cost table (default: shipped H200)")
    add("--json", action="store_true", help="print the prediction as one JSON object")
    add("--plot", help="write a PNG of predicted gain against tokens per GPU, EP 8/32/72")
    add("--measure", action="store_true", help="measure a cost table on the device")
    add("--out", help="--measure: where to write the table")
    add("--small", action="store_true", help="--measure: tiny grids (a CPU check of the code)")
    add("--sections", type=_section_names,
        help="--measure: only these sections, into the table at --out")  # fmt: skip
    options.add_arguments(parser.add_argument_group("serving stack"), StackFlags)
    args = parser.parse_args(argv)
    if args.measure and not args.out:
        parser.error("--measure needs --out FILE")
    if args.sections is not None and not (args.measure and os.path.exists(args.out)):
        parser.error("--sections measures into an existing --measure --out FILE")
    if args.imbalance < 1:
        parser.error(f"--imbalance must be >= 1, got {args.imbalance}")
    try:
        args.serving_stack = resolve_stack(options.from_namespace(StackFlags, args), args.mode)
        if args.serving_stack.exchange.topology != "flat":
            step_exchange.node_shape(args.ep, args.serving_stack.exchange.gpus_per_node)
    except ValueError as error:
        parser.error(str(error))
    return args


def _section_names(text: str) -> list[str]:
    """``--sections``: comma-separated names of the cost table's sections."""
    names = [name for name in text.split(",") if name]
    known = step_costs.SECTIONS + step_costs.OPTIONAL_SECTIONS
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: sections are {', '.join(known)}")
    return names


def _measure(args) -> None:
    from jtbo.bench import step_costs_measure  # noqa: PLC0415  (imports jax's kernels)

    def save(table):
        with open(args.out, "w") as file:
            json.dump(table, file, indent=1)

    into = None
    if args.sections is not None:
        with open(args.out) as file:
            into = json.load(file)
    table = step_costs_measure.measure(args.small, save, args.sections, into)
    step_costs.check(table)
    print(
        f"wrote {args.out}: {table['device']}, slowdown {table['slowdown']}, "
        f"host {table['host_ms']:.3f} ms"
    )


def inputs_of(args) -> step_model.StepInputs:
    """The ``StepInputs`` of parsed flags (the imbalance read from ``--routing-stats`` if
    given)."""
    stack = args.serving_stack
    link = step_exchange.Link(args.link_gbps, args.link_latency_us, stack.engine)
    imbalance = args.imbalance
    if args.routing_stats is not None:
        config = MODELS[args.model]()
        imbalance = step_model.imbalance_from_stats(
            args.routing_stats, config, args.ep, args.tokens_per_gpu
        )
    return step_model.StepInputs(
        args.ep, args.mode, args.tokens_per_gpu, link, args.prompt_len, args.context, imbalance,
        stack.exchange, stack.decode_attention, args.host_ms, stack.expert_gemm,
    )  # fmt: skip


def plot(path: str, config, base: step_model.StepInputs, costs) -> None:
    """Writes the gain-against-tokens PNG (``PLOT_EP`` curves).

    Raises:
      ImportError: matplotlib is not installed (the ``test`` extra has it).
    """
    try:
        import matplotlib  # noqa: PLC0415  (optional: --plot only)

        matplotlib.use("Agg")
        from matplotlib import pyplot  # noqa: PLC0415
    except ImportError as error:
        raise ImportError("--plot needs matplotlib (pip install 'jtbo[test]')") from error
    curves = step_model.sweep(config, base, PLOT_EP, PLOT_TOKENS, costs)
    figure, axes = pyplot.subplots(figsize=(6, 4))
    for ep, gains in curves.items():
        axes.plot(PLOT_TOKENS, [100 * g for g in gains], marker="o", label=f"EP {ep}")
    axes.axhline(0, color="gray", linewidth=0.8)
    axes.set(xscale="log", xlabel="tokens per GPU", ylabel="predicted TBO gain (%)")
    axes.set_title(f"{base.mode}, {base.link.gbps:g} GB/s per GPU")
    axes.legend()
    figure.savefig(path, dpi=100, bbox_inches="tight")
    pyplot.close(figure)


def weight_bytes(config, ep: int, expert_dtype: str) -> dict[str, float]:
    """Parameter bytes on one GPU of an EP group of ``ep`` GPUs (attn_tp 1, bf16 but the
    routed experts; ``jtbo.models.param_bytes``), by group and in all.

    Args:
      config: the model.
      ep: GPUs the routed experts are spread over.
      expert_dtype: one of ``EXPERT_DTYPES``.

    Returns:
      ``{"routed_experts", "attention", "other", "total"}`` bytes per GPU.
    """
    stored = None if expert_dtype == "bfloat16" else expert_dtype
    counted = param_bytes.parameter_bytes(dataclasses.replace(config, expert_dtype=stored), 2)
    return dict(
        routed_experts=counted.routed_experts / ep, attention=counted.attention_heads,
        other=counted.replicated, total=counted.per_device(ep),
    )  # fmt: skip


def weights_line(model: str, config, ep: int, expert_dtype: str) -> str:
    """The ``--expert-dtype`` line: one GPU's weight bytes, and with the other expert dtype."""
    own = weight_bytes(config, ep, expert_dtype)
    other = next(d for d in EXPERT_DTYPES if d != expert_dtype)
    return (
        f"{model} weights per GPU at EP{ep}: {own['total'] / 1e9:.1f} GB (routed experts "
        f"{expert_dtype} {own['routed_experts'] / 1e9:.1f} GB, attention "
        f"{own['attention'] / 1e9:.1f} GB, other {own['other'] / 1e9:.1f} GB, bf16 but the "
        f"experts); {other} experts: {weight_bytes(config, ep, other)['total'] / 1e9:.1f} GB"
    )


def main(argv: list[str]) -> None:
    """Predicts one step (or measures a table with ``--measure``); see the module docstring."""
    args = _parse(argv)
    if args.measure:
        _measure(args)
        return
    config, costs, inputs = MODELS[args.model](), step_costs.load(args.table), inputs_of(args)
    made = step_model.predict(config, inputs, costs)
    if args.plot:
        plot(args.plot, config, inputs, costs)
    weights = weight_bytes(config, args.ep, args.expert_dtype)
    if args.json:
        print(json.dumps(dict(
            made.as_json(), inputs=dataclasses.asdict(inputs), model=args.model,
            stack=args.stack, expert_dtype=args.expert_dtype, weight_bytes_per_gpu=weights,
        )))  # fmt: skip
        return
    print(
        f"{args.model} EP{args.ep} {args.mode} {args.tokens_per_gpu} tokens/GPU, "
        f"{args.link_gbps:g} GB/s: plain {made.plain_ms:.3f} ms, TBO {made.tbo_ms:.3f} ms, "
        f"TBO / plain {made.tbo_ms / made.plain_ms:.3f}, gain {100 * made.gain:+.1f} %"
    )
    print(describe_stack(args.stack, args.serving_stack))
    print(weights_line(args.model, config, args.ep, args.expert_dtype))
