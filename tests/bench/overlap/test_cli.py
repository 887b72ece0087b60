"""``python -m jtbo.bench overlap`` in process on the CPU (8 devices): the table, the
balanced matmul count, a bad ``--bytes``, and the benchmark's listing."""

import pytest

from jtbo.bench import __main__ as bench_main
from jtbo.bench import overlap
from tests.bench.overlap import runs


def test_in_process_run_prints_a_row_per_collective(capsys):
    """End to end in the default, pinned windows (the check passes through the barriers)."""
    overlap.main(runs.TINY)
    out = capsys.readouterr().out
    rows = runs.table_rows(out)
    assert [row[1] for row in rows] == list(overlap.COLLECTIVES)
    for row in rows:
        assert row[0] == "default" and row[2:4] == ["pinned", "64.0 KiB"], row
        runs.assert_measured(row)
    assert "8 x cpu (cpu)" in out and "windows pinned; matmuls/window: all_to_all 2" in out
    assert out.rstrip().splitlines()[-1] == "| " + " | ".join(rows[-1]) + " |"  # table last


def test_auto_balanced_matmul_count_runs(capsys):
    overlap.main(["--bytes", "64KiB", "--matmul", "128", "--chain", "1", "--iters", "1",
                  "--collectives", "all_to_all"])  # fmt: skip
    count = int(capsys.readouterr().out.split("matmuls/window: all_to_all ")[1].split()[0])
    assert 1 <= count <= overlap.MAX_MATMULS_PER_WINDOW


def test_bytes_not_divisible_by_the_devices_is_rejected_by_main():
    with pytest.raises(ValueError, match="--bytes 1000"):
        overlap.main(["--bytes", "1000", "--iters", "1"])


def test_the_package_is_a_listed_benchmark_with_its_docstring_as_help(capsys):
    assert "overlap" in bench_main._available()
    with pytest.raises(SystemExit):
        bench_main.main(["overlap", "--help"])
    assert "hidden = (comm + compute - both) / min(comm, compute)" in capsys.readouterr().out
