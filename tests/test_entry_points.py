"""The demo's platform check and ``python -m jtbo.bench --help`` (in this process, CPU)."""

import pytest

from jtbo.bench import __main__ as bench_main
from jtbo.cli import demo


def test_demo_refuses_when_a_gpu_is_expected_on_the_cpu(capsys, monkeypatch):
    monkeypatch.delenv("JTBO_EXPECT_GPU", raising=False)
    assert demo.main(["--expect-gpu"]) == demo.EXIT_NOT_ON_GPU
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("jtbo ")  # the summary line comes first
    assert out.splitlines()[1].startswith("platform: cpu")
    assert "GPU EXPECTED, BUT JAX RUNS ON CPU" in err


def test_demo_reads_the_expectation_from_the_environment(monkeypatch):
    monkeypatch.setenv("JTBO_EXPECT_GPU", "1")
    assert demo._parser().parse_args([]).expect_gpu
    monkeypatch.setenv("JTBO_EXPECT_GPU", "0")
    assert not demo._parser().parse_args([]).expect_gpu


def test_bench_help_lists_every_bench_and_exits_zero(capsys):
    assert bench_main.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("kernels", "attention", "split", "tbo", "overlap", "grouped_gemm"):
        assert f"  {name}\n" in out


def test_bench_without_a_name_prints_usage_and_fails(capsys):
    assert bench_main.main([]) == bench_main.EXIT_USAGE
    assert "usage: python -m jtbo.bench" in capsys.readouterr().err
    assert bench_main.main(["nope"]) == bench_main.EXIT_USAGE


@pytest.mark.parametrize(("name", "devices"), [("split", "| cpu x8 |"), ("tbo", "not started")])
def test_bench_prints_the_summary_line_first(capsys, name, devices):
    """A bench that configures jax itself gets a line that starts no backend."""
    with pytest.raises(SystemExit):
        bench_main.main([name, "--help"])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("jtbo ") and devices in first
