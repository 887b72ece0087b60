"""Overlap report on a small toy stack compiled for 8 x H200: TBO covers >= 95 % of bytes."""

import pytest

from jtbo import aot
from jtbo.overlap import report

pytestmark = pytest.mark.skipif(not aot.aot_available(), reason="needs the aot extra")
_SMALL = ["--layers", "2", "--hidden", "256", "--intermediate", "256", "--experts", "16"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--mode", "prefill", "--tokens", "256"],
        ["--mode", "decode", "--moe", "dp", "--tokens", "64"],
    ],
)
def test_tbo_coverage_target(flags, capsys, tmp_path):
    png = tmp_path / "timeline.png"
    result = report.main([*_SMALL, *flags, "--png", str(png)])
    printed = capsys.readouterr().out
    assert result.coverage >= 0.95, printed
    assert all(w.micro_batch in ("tbo_a", "tbo_b") for w in result.windows)
    assert len(result.windows) == 8  # 2 layers x 2 collectives x 2 micro-batches
    assert "xla_gpu_dot_merger_threshold_mb=0" in printed and "coverage" in printed
    assert png.stat().st_size > 1000


def test_plain_step_has_no_micro_batch_coverage(capsys):
    result = report.main([*_SMALL, "--mode", "prefill", "--tokens", "256", "--no-tbo"])
    capsys.readouterr()
    assert result.coverage == 0.0
    assert len(result.windows) == 4 and all(w.micro_batch is None for w in result.windows)
