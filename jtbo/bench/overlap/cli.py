"""The command line: flags, then the probe in this process or in child processes, and the
report."""

import argparse
import re

import jtbo.bench.overlap
from jtbo.bench.overlap import check, children, collectives, probe, processes, programs, table
from jtbo.bench.overlap import results as results_lib
from jtbo.bench.overlap import variants as variants_lib
from jtbo.core import cli_arguments


def _byte_count(text: str) -> int:
    """``65536``, ``64KiB``, ``448MiB`` or ``1GiB`` as a number of bytes."""
    match = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB)?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"bytes must be N, NKiB, NMiB or NGiB, got {text!r}")
    scale = {None: 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[match.group(2)]
    return int(match.group(1)) * scale


def _collective_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in collectives.COLLECTIVES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"collectives must be among {list(collectives.COLLECTIVES)}"
        )
    return names


def parser() -> argparse.ArgumentParser:
    """The flags of ``python -m jtbo.bench overlap`` (the package docstring as help)."""
    result = argparse.ArgumentParser(
        prog="python -m jtbo.bench overlap", description=jtbo.bench.overlap.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add, names = result.add_argument, list(collectives.COLLECTIVES)
    add("--collectives", type=_collective_names,
        help="comma-separated, from " + ",".join(names) + "; default: all (all but "
             "all_to_all_peer_copy with --processes > 1: it runs within one process)")  # fmt: skip
    add("--bytes", type=_byte_count, help="per device and exchange (see above); 448MiB on GPU")
    add(
        "--matmul",
        type=cli_arguments.positive_int,
        help="square matmul size N (8192 on GPU, 128 on CPU)",
    )
    add(
        "--chain",
        type=cli_arguments.positive_int,
        default=3,
        help="collectives (windows) per program",
    )
    add(
        "--matmuls-per-window",
        type=cli_arguments.positive_int,
        help="default: balanced to the collective",
    )
    add(
        "--iters",
        type=cli_arguments.positive_int,
        default=10,
        help="timed runs per program (median)",
    )
    add("--dtype", choices=tuple(check.TOLERANCE), default="bfloat16")
    add("--seed", type=int, default=0, help="seed of the random inputs")
    add("--xla-option", action="append", default=[], metavar="K=V", help="compile option")
    add("--env", action="append", default=[], metavar="K=V", help="env var (subprocess)")
    add("--variant", action="append", default=[], metavar="NAME=SPEC",
        help="SPEC: comma-separated xla:K=V / env:K=V / opt:windows=MODE items; one "
             "subprocess each")  # fmt: skip
    add("--windows", choices=programs.WINDOW_MODES, default=programs.WINDOW_MODES[0],
        help="both program: windows tied by barriers (pinned) or left to XLA (free)")  # fmt: skip
    add(
        "--processes",
        type=cli_arguments.positive_int,
        default=1,
        help="one process per local device",
    )
    add("--cpu-devices", type=cli_arguments.positive_int, default=2, help="CPU devices per process")
    add("--variant-timeout", type=float, default=900.0, help="seconds per variant")
    add("--profile", metavar="DIR", help="trace the comm-alone and both programs into DIR")
    # Set by the parent for its children only.
    add("--worker", type=int, help=argparse.SUPPRESS)
    add("--coordinator", help=argparse.SUPPRESS)
    add("--variant-name", default="default", help=argparse.SUPPRESS)
    return result


def _in_process(
    args: argparse.Namespace, variant: variants_lib.Variant
) -> results_lib.VariantOutcome:
    """Measures here, in this process's JAX backend (no --env, --variant or --processes)."""
    collected = {"info": [], "result": []}

    def emit(kind: str, payload: object) -> None:
        if kind == "result":
            print(table.progress_line(payload), flush=True)
        collected[kind].append(payload)

    probe.measure(args, variant.name, emit)
    return results_lib.VariantOutcome(variant, collected["info"][0], tuple(collected["result"]))


def default_collectives(processes: int) -> list[str]:
    """Every collective the probe can run with ``processes`` processes."""
    names = list(collectives.COLLECTIVES)
    return names if processes == 1 else [n for n in names if n != "all_to_all_peer_copy"]


def main(argv: list[str]) -> None:
    """Runs the probe (see the package docstring).

    Raises:
      ValueError: malformed settings or sizes.
      RuntimeError: an in-process program computes something else than its reference.
      SystemExit: a variant's child process failed (after the table is printed).
    """
    args = parser().parse_args(argv)
    if args.collectives is None:
        args.collectives = default_collectives(args.processes)
    if args.worker is not None:
        processes.worker_main(args)
        return
    variants = variants_lib.variants_of(args)
    if not args.variant and not args.env and args.processes == 1:
        table.print_report([_in_process(args, variants[0])])
        return
    outcomes = [children.run_variant(args, variant) for variant in variants]
    table.print_report(outcomes)
    failed = [outcome.variant.name for outcome in outcomes if outcome.failure]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(outcomes)} variant(s) failed: {failed}")
