"""The benches' shared argument types: a bad count stops argparse before anything compiles."""

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jtbo.bench import arguments, attention, grouped_gemm, kernels, serve, tbo
from jtbo.bench.overlap import cli as overlap_cli


@given(st.integers(min_value=1, max_value=10**9))
def test_positive_int_takes_every_integer_from_one(value):
    assert arguments.positive_int(str(value)) == value


@pytest.mark.parametrize(
    "text, message", [("0", "must be >= 1, got 0"), ("-3", "got -3"), ("x", "'x' is not")]
)
def test_positive_int_refuses_what_is_not_a_count(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        arguments.positive_int(text)


@pytest.mark.parametrize(
    "parse, flag",
    [
        (tbo._parser().parse_args, "--iters"),
        (attention._parse, "--iters"),
        (grouped_gemm._parse, "--iters"),
        (grouped_gemm._parse, "--reps"),
        (kernels._parse, "--reps"),
        (serve._parser().parse_args, "--iters"),
        (overlap_cli.parser().parse_args, "--iters"),
    ],
    ids=[
        "tbo",
        "attention",
        "grouped_gemm",
        "grouped_gemm-reps",
        "kernels-reps",
        "serve",
        "overlap",
    ],
)
def test_every_bench_refuses_zero_timed_runs_with_a_usage_error(parse, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse([flag, "0"])
    assert exit_info.value.code == 2
    assert f"{flag}: must be >= 1, got 0" in capsys.readouterr().err
