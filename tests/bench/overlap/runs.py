"""Shared by the ``python -m jtbo.bench overlap`` tests: tiny sizes and table parsing."""

import math

TINY = ["--bytes", "64KiB", "--matmul", "64", "--chain", "2", "--iters", "2",
        "--matmuls-per-window", "2"]  # fmt: skip


def table_rows(text: str) -> list[list[str]]:
    """The table's rows (below its header) as lists of cells."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| variant | collective | windows |"), lines
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def assert_measured(row: list[str]) -> None:
    """A row of positive times and bandwidth and a finite hidden fraction."""
    comm, compute, both, hidden, gbps = (float(cell) for cell in row[4:])
    assert min(comm, compute, both, gbps) > 0, row
    assert math.isfinite(hidden), row
