"""The report: a header line per variant, failures' stderr tails, then the table (last)."""

from collections.abc import Sequence

from jtbo.bench.overlap import results as results_lib
from jtbo.bench.overlap import variants as variants_lib

TABLE_HEADER = (
    "| variant | collective | windows | bytes/exchange | comm ms | compute ms | both ms "
    "| hidden | comm GB/s |\n|---|---|---|---|---|---|---|---|---|"
)


def _format_bytes(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def result_row(result: results_lib.ProbeResult) -> str:
    """One table row."""
    return (
        f"| {result.variant} | {result.collective} | {result.windows} "
        f"| {_format_bytes(result.bytes_per_exchange)} "
        f"| {result.comm_s * 1e3:.3f} | {result.compute_s * 1e3:.3f} | {result.both_s * 1e3:.3f} "
        f"| {result.hidden:.3f} | {result.comm_gbps:.2f} |"
    )


def progress_line(result: results_lib.ProbeResult) -> str:
    """The line printed as soon as one collective is measured."""
    return (
        f"{result.collective}: {result.matmuls_per_window} matmuls/window, {result.windows} "
        f"windows; comm "
        f"{result.comm_s * 1e3:.3f} ms, compute {result.compute_s * 1e3:.3f} ms, both "
        f"{result.both_s * 1e3:.3f} ms, hidden {result.hidden:.3f}"
    )


def header_line(
    variant: variants_lib.Variant,
    info: results_lib.RunInfo | None,
    results: Sequence[results_lib.ProbeResult],
) -> str:
    """The header line of a variant: its settings and what it ran on."""
    settings = variant.spec() or "defaults"
    if info is None:
        return f"variant {variant.name} ({settings}): no run information (it failed first)"
    counts = ", ".join(f"{r.collective} {r.matmuls_per_window}" for r in results)
    return (
        f"variant {variant.name} ({settings}): {info.devices} x {info.device_kind} "
        f"({info.platform}), {info.processes} process(es), jax {info.jax_version}; "
        f"bytes/exchange {_format_bytes(info.bytes_per_exchange)}, matmul {info.matmul}, "
        f"chain {info.chain}, iters {info.iters}, {info.dtype}, windows {info.windows}; "
        f"matmuls/window: {counts}"
    )


def _failure_row(outcome: results_lib.VariantOutcome) -> str:
    last = outcome.stderr_tail.strip().splitlines()[-1:] or [""]
    cell = f"FAILED: {outcome.failure}: {last[0][:160]}".replace("|", "/")
    return f"| {outcome.variant.name} | {cell} | - | - | - | - | - | - | - |"


def print_report(outcomes: Sequence[results_lib.VariantOutcome]) -> None:
    """Header lines, failures' stderr tails, then the table (last)."""
    for outcome in outcomes:
        print(header_line(outcome.variant, outcome.info, outcome.results))
    for outcome in outcomes:
        if outcome.failure:
            print(f"\nvariant {outcome.variant.name} failed ({outcome.failure}); stderr tail:")
            print(outcome.stderr_tail)
    print(TABLE_HEADER)
    for outcome in outcomes:
        for result in outcome.results:
            print(result_row(result))
        if outcome.failure:
            print(_failure_row(outcome))
