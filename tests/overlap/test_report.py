"""Overlap report: coverage and priced window fill of the model step's compiles.

The summary math and the rendering run on hand-made windows; the compiles need the ``aot``
extra (an N x H200 compile on the CPU) and are skipped without it.
"""

import pytest

from jtbo import aot
from jtbo.overlap import hlo_schedule, report, schedule_costs

needs_aot = pytest.mark.skipif(not aot.aot_available(), reason="needs the aot extra")
_SMALL = ["--layers", "2", "--hidden", "256", "--intermediate", "256", "--experts", "16"]
MIB = 1 << 20


def _fill(start: str, num_bytes: int, exchange_us: float, other_us: float, **kw):
    return schedule_costs.WindowFill(
        start=start, kind=kw.get("kind", "all-to-all"), micro_batch=kw.get("micro_batch"),
        num_bytes=num_bytes, exchange_us=exchange_us, compute_us=kw.get("compute_us", other_us),
        other_micro_batch_us=other_us,
    )  # fmt: skip


def _window(start: str, num_bytes: int, *, is_async=True, micro_batch="tbo_a"):
    slot = hlo_schedule.ComputeSlot("fusion.1", "fusion", "tbo_b")
    return hlo_schedule.CollectiveWindow(
        computation="main", kind="all-to-all", start=start, done=start.replace("start", "done"),
        start_index=0, done_index=2, num_bytes=num_bytes, micro_batch=micro_batch,
        is_async=is_async, between=(slot,) if is_async else (),
    )  # fmt: skip


def test_fill_summary_weights_by_bytes():
    fills = [
        _fill("big-filled", 6 * MIB, exchange_us=100.0, other_us=100.0),  # fill exactly 1
        _fill("big-exposed", 3 * MIB, exchange_us=100.0, other_us=25.0),  # fill 0.25
        _fill("small-exposed", 1 * MIB - 1, exchange_us=20.0, other_us=0.0),  # below 1 MiB
    ]
    summary = report.fill_summary(fills)
    # One exposed 3 MiB exchange weighs more than any number of tiny filled ones.
    assert summary.filled_coverage == pytest.approx(6 * MIB / (9 * MIB + MIB - 1))
    assert summary.min_fill == pytest.approx(0.25) and summary.min_fill_start == "big-exposed"
    assert summary.large_bytes == report.LARGE_BYTES == MIB


def test_fill_summary_threshold_and_empty_cases():
    fills = [
        _fill("at-threshold", MIB, exchange_us=10.0, other_us=5.0),  # 0.5, included (>=)
        _fill("tiny", 16, exchange_us=20.0, other_us=0.0),  # 0.0, too small to count
    ]
    assert report.fill_summary(fills).min_fill == pytest.approx(0.5)
    above = report.fill_summary(fills, large_bytes=MIB + 1)
    assert above.min_fill is None and above.min_fill_start is None
    assert report.fill_summary(fills, large_bytes=0).min_fill == 0.0
    empty = report.fill_summary([])
    assert empty.filled_coverage == 0.0 and empty.min_fill is None


def _hand_report(fills, windows) -> report.OverlapReport:
    return report.OverlapReport(
        windows=tuple(windows), compiler_options={"xla_x": 1}, coverage=1.0,
        any_compute_coverage=1.0, hlo_text="", fills=tuple(fills),
        cost_model=schedule_costs.CostModel(link_bytes_per_s=40e9),
        fill_summary=report.fill_summary(fills),
    )  # fmt: skip


def test_format_report_prints_fills_and_summary():
    windows = [_window("all-to-all-start", 466 * MIB), _window("all-to-all-start.1", 4 * MIB)]
    fills = [
        _fill("all-to-all-start", 466 * MIB, exchange_us=12236.8, other_us=61.2, compute_us=70),
        _fill("all-to-all-start.1", 4 * MIB, exchange_us=125.0, other_us=250.0),
    ]
    text = report.format_report(_hand_report(fills, windows), title="two exchanges")
    lines = text.splitlines()
    assert lines[0] == "two exchanges"
    assert "est. exchange 12,236.8 us, other micro-batch compute 61.2 us" in lines[3]
    assert "(all compute 70.0 us): fill 0.01  <- EXPOSED" in lines[3]
    assert lines[5].endswith("fill 2.00")  # filled: no flag
    assert "coverage (other micro-batch) = 1.000" in text  # the old metric, unchanged
    assert (
        "filled coverage (est. other micro-batch compute >= exchange) = 0.009; "
        "min fill of collectives >= 1 MiB = 0.01 (all-to-all-start)"
    ) in text
    assert "priced with link 40 GB/s" in text


def test_format_report_without_large_collectives():
    fills = [_fill("all-reduce-start", 16, exchange_us=20.0, other_us=0.0)]
    text = report.format_report(_hand_report(fills, [_window("all-reduce-start", 16)]))
    assert "fill 0.00" in text and "EXPOSED" not in text  # 16 bytes: launch-bound
    assert "min fill of collectives >= 1 MiB = n/a (none that large)" in text


@needs_aot
@pytest.mark.parametrize(
    "flags, min_coverage",
    [
        (["--mode", "prefill", "--tokens", "256"], 0.95),
        # XLA leaves B's second-layer gather synchronous in this small decode step (8 x 1).
        (["--mode", "decode", "--moe", "dp", "--tokens", "64"], 0.85),
    ],
)
def test_tbo_coverage_target(flags, min_coverage, capsys, tmp_path):
    png = tmp_path / "timeline.png"
    result = report.main([*_SMALL, *flags, "--png", str(png)])
    printed = capsys.readouterr().out
    assert result.coverage >= min_coverage, printed
    assert sum(not w.is_async for w in result.windows) <= 1, printed
    # 2 layers x 2 row exchanges x 2 micro-batches; the rest are small: EP overflow counters,
    # the DP MoE's gathers of expert ids and weights.
    exchanges = [w for w in result.windows if w.num_bytes >= 64 * 1024]
    assert len(exchanges) == 8, printed
    assert all(w.micro_batch in ("tbo_a", "tbo_b") for w in exchanges)
    assert "xla_gpu_dot_merger_threshold_mb=0" in printed and "coverage" in printed
    assert [f.start for f in result.fills] == [w.start for w in result.windows]
    assert "filled coverage" in printed and "priced with link 600 GB/s" in printed
    assert png.stat().st_size > 1000


@needs_aot
def test_plain_step_has_no_micro_batch_coverage(capsys):
    result = report.main([*_SMALL, "--mode", "prefill", "--tokens", "256", "--no-tbo"])
    capsys.readouterr()
    assert result.coverage == 0.0
    exchanges = [w for w in result.windows if w.num_bytes >= 64 * 1024]
    assert len(exchanges) == 4 and all(w.micro_batch is None for w in result.windows)
    # No micro-batches, no other-micro-batch compute: nothing is filled either.
    assert result.filled_coverage == 0.0 and all(f.fill == 0.0 for f in result.fills)


@needs_aot
def test_model_step_report_prices_a_slower_link(capsys):
    flags = ["--model", "tiny", "--devices", "2", "--mode", "prefill", "--tokens", "64"]
    slow = report.main([*flags, "--link-gbps", "0.1", "--large-mib", "0.01"])
    printed = capsys.readouterr().out
    assert "model step tiny" in printed and "dp=2 x attn_tp=1" in printed
    assert (
        "priced with link 0.1 GB/s" in printed and "min fill of collectives >= 0.01 MiB" in printed
    )
    assert slow.coverage >= 0.95 and slow.fill_summary.large_bytes == int(0.01 * MIB)
    # The same schedule at the default 600 GB/s: every exchange cheaper, so fuller windows.
    fast = report.collective_fills(slow.hlo_text, slow.windows, report.DEFAULT_COST_MODEL)
    big = [i for i, f in enumerate(fast) if f.num_bytes > 1024]
    assert big and all(fast[i].exchange_us < slow.fills[i].exchange_us for i in big)
    assert all(fast[i].fill > slow.fills[i].fill for i in big if fast[i].other_micro_batch_us)
    assert report.fill_summary(fast).filled_coverage > slow.filled_coverage
