"""``--processes 2``: 2 processes x 2 CPU devices under ``jax.distributed``."""

from jtbo.bench import overlap
from tests.bench.overlap import runs


def test_two_processes_under_jax_distributed(capsys):
    """SUBPROCESS, ~8 s: 2 processes x 2 CPU devices (gloo); process 0 reports the row."""
    overlap.main([*runs.TINY, "--processes", "2", "--collectives", "all_to_all"])
    out = capsys.readouterr().out
    (row,) = runs.table_rows(out)
    assert row[:2] == ["default", "all_to_all"]
    runs.assert_measured(row)
    assert "4 x cpu (cpu), 2 process(es)" in out
