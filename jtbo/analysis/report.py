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

Coverage cannot fail when a window holds one tiny fusion beside a large exchange, so the
report also prices every window (``schedule_costs.window_fill`` under a ``CostModel``):

    fill = estimated other-micro-batch compute in the window / estimated exchange time
    filled_coverage = bytes of collectives with fill >= 1 / bytes of all collectives

and the lowest fill among collectives of at least ``LARGE_BYTES`` (a synchronous collective
has fill 0). These are compile-time estimates (a roofline for compute, bytes over
``CostModel.link_bytes_per_s`` for the exchange), not measurements.

``python -m jtbo.analysis.report_cli`` reports the model's own step (``report_cli``). Findings
are in docs/benchmarks/ ("Overlap coverage (8xH200 compile on the CPU)", "Run-time overlap on
two H200s").
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jtbo.analysis import hlo_schedule, schedule_costs

LARGE_BYTES = 1 << 20  # smaller exchanges are launch-bound: their fill matters little
DEFAULT_COST_MODEL = schedule_costs.CostModel()  # NVLink between two H200s


@dataclasses.dataclass(frozen=True)
class FillSummary:
    """How well the priced windows hide their exchanges (see ``fill_summary``)."""

    filled_coverage: float  # bytes of collectives with fill >= 1 / all collective bytes
    min_fill: float | None  # lowest fill of a collective of >= large_bytes (None: none)
    min_fill_start: str | None  # that collective's start instruction
    large_bytes: int  # the size threshold of min_fill


@dataclasses.dataclass(frozen=True)
class OverlapReport:
    """The collectives of one compiled step and how well they are hidden."""

    windows: tuple[hlo_schedule.CollectiveWindow, ...]  # every collective, schedule order
    compiler_options: dict[str, Any]  # the options the step was compiled with
    coverage: float  # covered bytes / all collective bytes (other micro-batch compute)
    any_compute_coverage: float  # same, counting any compute in the window
    hlo_text: str  # the compiled module
    fills: tuple[schedule_costs.WindowFill, ...]  # one per window, same order
    cost_model: schedule_costs.CostModel  # the figures the fills were priced with
    fill_summary: FillSummary

    @property
    def filled_coverage(self) -> float:
        """Share of collective bytes whose window fill is >= 1 (``FillSummary``)."""
        return self.fill_summary.filled_coverage

    @property
    def min_fill(self) -> float | None:
        """Lowest fill among the large collectives (``FillSummary``)."""
        return self.fill_summary.min_fill


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


def collective_fills(
    text: str,
    windows: Sequence[hlo_schedule.CollectiveWindow],
    model: schedule_costs.CostModel,
) -> tuple[schedule_costs.WindowFill, ...]:
    """Prices every collective window of a compiled module.

    Args:
      text: the compiled module's text.
      windows: its ``hlo_schedule.collective_windows``.
      model: device and link figures.

    Returns:
      One ``WindowFill`` per window, in the order of ``windows``; a synchronous collective
      (which ``window_fill`` leaves out) gets one with no compute beside it, fill 0, so that
      its bytes count as exposed, as in ``coverage``.
    """
    priced = {fill.start: fill for fill in schedule_costs.window_fill(text, model)}
    return tuple(priced.get(window.start) or _lone_fill(window, model) for window in windows)


def _lone_fill(
    window: hlo_schedule.CollectiveWindow, model: schedule_costs.CostModel
) -> schedule_costs.WindowFill:
    return schedule_costs.WindowFill(
        start=window.start, kind=window.kind, micro_batch=window.micro_batch,
        num_bytes=window.num_bytes,
        exchange_us=schedule_costs.collective_us(window.num_bytes, model),
        compute_us=0.0, other_micro_batch_us=0.0,
    )  # fmt: skip


def fill_summary(
    fills: Sequence[schedule_costs.WindowFill], *, large_bytes: int = LARGE_BYTES
) -> FillSummary:
    """Byte-weighted filled coverage and the lowest fill of the large collectives.

    Args:
      fills: every collective of a step, priced (``collective_fills``).
      large_bytes: ``min_fill`` looks at collectives of at least this many bytes.

    Returns:
      The summary; ``filled_coverage`` is 0 when there are no collective bytes, ``min_fill``
      None when no collective is that large.
    """
    total = sum(fill.num_bytes for fill in fills)
    filled = sum(fill.num_bytes for fill in fills if fill.fill >= 1.0)
    large = [fill for fill in fills if fill.num_bytes >= large_bytes]
    lowest = min(large, key=lambda fill: fill.fill, default=None)
    return FillSummary(
        filled_coverage=filled / total if total else 0.0,
        min_fill=lowest.fill if lowest else None,
        min_fill_start=lowest.start if lowest else None,
        large_bytes=large_bytes,
    )


def overlap_report(
    step: Callable[..., Any],
    abstract_args: Sequence[Any],
    *,
    compiler_options: dict[str, Any] | None = None,
    cost_model: schedule_costs.CostModel = DEFAULT_COST_MODEL,
    large_bytes: int = LARGE_BYTES,
) -> OverlapReport:
    """Compiles ``step`` for ``abstract_args`` and measures its overlap.

    Args:
      step: a ``jax.jit``-wrapped callable.
      abstract_args: ``jax.ShapeDtypeStruct``s (with shardings over the target mesh) or arrays.
      compiler_options: XLA options for the compile (e.g. ``xla_options.tbo_compiler_options()``).
      cost_model: device and link figures the windows are priced with.
      large_bytes: the size threshold of ``FillSummary.min_fill``.

    Returns:
      The report.
    """
    options = dict(compiler_options or {})
    compiled = step.lower(*abstract_args).compile(compiler_options=options or None)
    text = compiled.as_text()
    windows = tuple(hlo_schedule.collective_windows(text))
    fills = collective_fills(text, windows, cost_model)
    return OverlapReport(
        windows=windows,
        compiler_options=options,
        coverage=coverage(windows),
        any_compute_coverage=coverage(windows, any_compute=True),
        hlo_text=text,
        fills=fills,
        cost_model=cost_model,
        fill_summary=fill_summary(fills, large_bytes=large_bytes),
    )


def format_report(report: OverlapReport, *, title: str = "") -> str:
    """Renders the report: options, two lines per collective, the coverages and fills.

    Args:
      report: the report.
      title: a first line (none when empty).

    Returns:
      The text, without a trailing newline.
    """
    lines = [title] if title else []
    lines.append("compiler options: " + (_format_options(report.compiler_options) or "(none)"))
    for window, fill in zip(report.windows, report.fills, strict=True):
        lines.append(_window_line(window))
        lines.append(_fill_line(fill, report.fill_summary.large_bytes))
    lines.append(
        f"coverage (other micro-batch) = {report.coverage:.3f}; "
        f"any compute = {report.any_compute_coverage:.3f}; "
        f"{len(report.windows)} collectives, {sum(not w.is_async for w in report.windows)} sync"
    )
    lines.extend(_summary_lines(report.fill_summary, report.cost_model))
    return "\n".join(lines)


def _window_line(window: hlo_schedule.CollectiveWindow) -> str:
    other = window.other_micro_batch_compute()
    return (
        f"  {window.kind:<15} {window.num_bytes:>12,d} B  by {window.micro_batch or '-':<6}"
        f" {'async' if window.is_async else 'SYNC '}  {window.start} .. {window.done}:"
        f" {len(window.between)} compute inside, {len(other)} of the other micro-batch"
        + (f" ({_summary(window.between)})" if window.between else "")
    )


def _fill_line(fill: schedule_costs.WindowFill, large_bytes: int) -> str:
    # Flag only large exchanges: a small one's time is mostly its launch cost.
    exposed = fill.fill < 1.0 and fill.num_bytes >= large_bytes
    return (
        f"      est. exchange {fill.exchange_us:,.1f} us, other micro-batch compute "
        f"{fill.other_micro_batch_us:,.1f} us (all compute {fill.compute_us:,.1f} us): "
        f"fill {fill.fill:.2f}" + ("  <- EXPOSED" if exposed else "")
    )


def _summary_lines(summary: FillSummary, model: schedule_costs.CostModel) -> list[str]:
    lowest = (
        f"{summary.min_fill:.2f} ({summary.min_fill_start})"
        if summary.min_fill is not None
        else "n/a (none that large)"
    )
    return [
        f"filled coverage (est. other micro-batch compute >= exchange) = "
        f"{summary.filled_coverage:.3f}; min fill of collectives >= "
        f"{_mib(summary.large_bytes)} = {lowest}",
        f"priced with link {model.link_bytes_per_s / 1e9:g} GB/s "
        f"+ {model.collective_launch_us:g} us per collective, matmul "
        f"{model.matmul_flops_per_s / 1e12:g} TF/s, "
        f"memory {model.memory_bytes_per_s / 1e12:g} TB/s",
    ]


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.3g} MiB"


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
    axes.set_title(f"coverage {report.coverage:.3f}, filled {report.filled_coverage:.3f}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
