"""The command lines' shared argument types: a bad count stops argparse before anything compiles."""

import argparse
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jtbo.bench import attention, grouped_gemm, kernels, serve, tbo
from jtbo.bench.overlap import cli as overlap_cli
from jtbo.core import cli_arguments


@given(st.integers(min_value=1, max_value=10**9))
def test_positive_int_takes_every_integer_from_one(value):
    assert cli_arguments.positive_int(str(value)) == value


@pytest.mark.parametrize(
    "text, message", [("0", "must be >= 1, got 0"), ("-3", "got -3"), ("x", "'x' is not")]
)
def test_positive_int_refuses_what_is_not_a_count(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        cli_arguments.positive_int(text)


@given(st.integers(min_value=0, max_value=10**9))
def test_non_negative_int_takes_zero_and_up(value):
    assert cli_arguments.non_negative_int(str(value)) == value


@given(st.floats(min_value=0, max_value=1e9, allow_nan=False))
def test_non_negative_float_takes_zero_and_up(value):
    assert cli_arguments.non_negative_float(repr(value)) == value


@given(st.floats(min_value=0, max_value=1, exclude_min=True))
def test_probability_takes_the_half_open_unit_interval(value):
    assert cli_arguments.probability(repr(value)) == value


@pytest.mark.parametrize(
    "parse, text, message",
    [
        (cli_arguments.non_negative_int, "-1", "must be >= 0, got -1"),
        (cli_arguments.non_negative_int, "1.5", "'1.5' is not an integer"),
        (cli_arguments.non_negative_float, "-0.5", "must be >= 0, got -0.5"),
        (cli_arguments.non_negative_float, "nan", "must be >= 0, got nan"),
        (cli_arguments.non_negative_float, "warm", "'warm' is not a number"),
        (cli_arguments.probability, "0", "must be in (0, 1], got 0"),
        (cli_arguments.probability, "1.01", "got 1.01"),
    ],
)
def test_the_other_types_refuse_values_outside_their_range(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        parse(text)


def test_paths_must_exist_as_the_kind_asked_for(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    assert cli_arguments.existing_directory(str(tmp_path)) == tmp_path
    assert cli_arguments.existing_file(str(tmp_path / "f.txt")) == tmp_path / "f.txt"
    with pytest.raises(argparse.ArgumentTypeError, match="no such directory"):
        cli_arguments.existing_directory(str(tmp_path / "f.txt"))
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        cli_arguments.existing_file(str(tmp_path))


def test_one_line_parser_errors_name_the_flag_without_the_usage_block(capsys):
    parser = cli_arguments.OneLineErrorParser(prog="prog")
    parser.add_argument("--count", type=cli_arguments.positive_int)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--count", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "prog: error: argument --count: must be >= 1, got 0 (--help lists the flags)"
    ]


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
