"""``python -m jtbo.bench attention``: flags, K/V bytes and the backend comparison (CPU smoke)."""

import json

import jax
import numpy as np
import pytest

from jtbo.bench import attention
from tests.attention import scenarios

# float32 dots run in TF32 on GPUs (scenarios.TF32_TOLERANCE).
AGREE = scenarios.f32_tolerance(1e-5)


def test_small_decode_run_reports_kv_bandwidth_and_agreement(capsys):
    attention.main(["--small", "--cases", "decode", "--iters", "1"])
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    native, pallas = results
    assert (native["backend"], pallas["backend"]) == ("native", "pallas")
    # 16 sequences x 128 positions x 2 KV heads x (32 + 32) dims x 4 bytes.
    assert native["kv_read_bytes"] == pallas["kv_read_bytes"] == 16 * 128 * 2 * 64 * 4
    assert pallas["max_abs_diff_vs_native"] < AGREE
    assert np.isclose(pallas["kv_gb_per_s"], pallas["kv_read_bytes"] / pallas["step_ms"] / 1e6)


def test_small_mla_verify_reads_only_the_latent_and_backends_agree(capsys):
    attention.main(["--small", "--mla", "--cases", "verify", "--iters", "1"])
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    native, pallas = results
    # 16 sequences x 128 positions x one latent row of 32 + 16 values x 4 bytes, no values.
    assert native["kv_read_bytes"] == pallas["kv_read_bytes"] == 16 * 128 * 48 * 4
    assert pallas["max_abs_diff_vs_native"] < AGREE and pallas["finite"]


@pytest.mark.parametrize(("flag", "value"), [("--cases", "prefill"), ("--backends", "flash")])
def test_unknown_case_or_backend_is_rejected(flag, value):
    with pytest.raises((SystemExit, ValueError)):
        attention.main([flag, value])


@pytest.mark.parametrize(("case", "flag"), [("extend", "--extend-"), ("decode", "--")])
def test_a_knob_list_sweeps_the_pallas_launch_shapes(capsys, case, flag):
    # The extend case sweeps the extend kernel's knobs, decode the paged kernel's.
    attention.main(["--small", "--cases", case, "--iters", "1", f"{flag}block-rows", "16,32",
                    f"{flag}num-warps", "4,8"])  # fmt: skip
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    native, *pallas = results
    assert native["kernel_config"] is None and len(pallas) == 4
    shapes = [(r["kernel_config"]["block_rows"], r["kernel_config"]["num_warps"]) for r in pallas]
    assert shapes == [(16, 4), (16, 8), (32, 4), (32, 8)]  # the first flag varies slowest
    assert all(r["max_abs_diff_vs_native"] < AGREE for r in pallas)
    if case == "decode":
        return
    # 2 prompts of 128 tokens, 4 heads of 32: 2 * 4 * (32 + 32) * 2 * 128 * 129 / 2 FLOPs.
    flops = 2 * 4 * 64 * 2 * 128 * 129 / 2
    for result in results:
        assert np.isclose(result["tflops"], flops / (result["step_ms"] / 1e3) / 1e12)
        assert result["dense_tflops"] > 0


@pytest.mark.parametrize("value", ["4,x", "24"])
def test_a_bad_knob_value_is_rejected(value):
    with pytest.raises(SystemExit):
        attention.main(["--small", "--block-rows", value])


def test_kernel_time_runs_everywhere_and_reports_only_gpu_figures(capsys):
    attention.main(["--small", "--cases", "extend", "--backends", "pallas", "--iters", "1",
                    "--kernel-time"])  # fmt: skip
    (result,) = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"
    ]
    assert result["finite"]
    gpu = jax.default_backend() == "gpu"
    assert ("kernel_ms" in result) == gpu and ("kernel_tflops" in result) == gpu
    assert not gpu or 0 < result["kernel_ms"] < result["step_ms"]
