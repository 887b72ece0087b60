"""Overlap report: the summary math and the rendering, on hand-made windows (the model step's
compiles are ``test_report_cli``'s)."""

import pytest

from jtbo.analysis import hlo_schedule, report, schedule_costs

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
