"""``python -m jtbo.analysis.report_cli``: coverage and priced window fill of the model step's
compiles. They need the ``aot`` extra (an N x H200 compile on the CPU) and skip without it.
"""

import pytest

from jtbo import aot
from jtbo.analysis import report, report_cli

needs_aot = pytest.mark.skipif(not aot.aot_available(), reason="needs the aot extra")
_SMALL = ["--layers", "2", "--hidden", "256", "--intermediate", "256", "--experts", "16"]
MIB = 1 << 20


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
    result = report_cli.main([*_SMALL, *flags, "--png", str(png)])
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
    result = report_cli.main([*_SMALL, "--mode", "prefill", "--tokens", "256", "--no-tbo"])
    capsys.readouterr()
    assert result.coverage == 0.0
    exchanges = [w for w in result.windows if w.num_bytes >= 64 * 1024]
    assert len(exchanges) == 4 and all(w.micro_batch is None for w in result.windows)
    # No micro-batches, no other-micro-batch compute: nothing is filled either.
    assert result.filled_coverage == 0.0 and all(f.fill == 0.0 for f in result.fills)


@needs_aot
def test_model_step_report_prices_a_slower_link(capsys):
    flags = ["--model", "tiny", "--devices", "2", "--mode", "prefill", "--tokens", "64"]
    slow = report_cli.main([*flags, "--link-gbps", "0.1", "--large-mib", "0.01"])
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
