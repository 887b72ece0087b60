"""``python -m jtbo.bench predict`` on the shipped table (CPU, no compiles)."""

import json

import pytest

from jtbo.analysis import step_costs
from jtbo.bench import predict


def test_json_has_times_and_a_breakdown(capsys):
    predict.main(["--model", "deepseek_v3", "--ep", "32", "--tokens-per-gpu", "4096", "--json"])
    made = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert made["plain_ms"] > 0 and made["tbo_ms"] > 0
    assert "experts" in made["per_operation"] and made["inputs"]["ep_size"] == 32


def test_bad_flags_stop_at_parse():
    with pytest.raises(SystemExit):
        predict.main(["--ep", "0"])
    with pytest.raises(SystemExit):
        predict.main(["--measure"])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the test extra)")
    path = tmp_path / "gain.png"
    predict.main(["--mode", "decode", "--tokens-per-gpu", "256", "--plot", str(path)])
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_weight_bytes_per_gpu_of_deepseek_v3_at_ep8(capsys):
    # FP8 routed experts halve the experts' bytes (plus a float32 scale per 128 x 128
    # block); attention and the rest stay bf16 and whole on every GPU.
    predict.main(["--model", "deepseek_v3", "--ep", "8", "--expert-dtype", "float8_e4m3fn"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("deepseek_v3 weights per GPU at EP8: 116.0 GB")
    assert "routed experts float8_e4m3fn 81.8 GB" in line and "bfloat16 experts: 197.7 GB" in line
    predict.main(["--model", "deepseek_v3", "--ep", "8", "--json"])
    weights = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["weight_bytes_per_gpu"]
    fp8 = predict.weight_bytes(predict.MODELS["deepseek_v3"](), 8, "float8_e4m3fn")
    assert weights["routed_experts"] == 2 * 58 * 256 * 3 * 7168 * 2048 / 8
    assert fp8["routed_experts"] == pytest.approx(weights["routed_experts"] / 2 * (1 + 4 / 128**2))
    assert fp8["total"] == fp8["routed_experts"] + fp8["attention"] + fp8["other"]


def _json(capsys, argv: list[str]) -> dict:
    predict.main([*argv, "--json"])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


V3_EP32 = ["--model", "deepseek_v3", "--ep", "32", "--tokens-per-gpu", "2048"]


def test_jtbo_stack_is_the_default(capsys):
    default = _json(capsys, V3_EP32)
    named = _json(capsys, [*V3_EP32, "--stack", "jtbo", "--dispatch-dtype", "bf16"])
    assert default["stack"] == "jtbo" and default["plain_ms"] == named["plain_ms"]
    assert default["inputs"]["exchange"]["topology"] == "flat"
    assert default["inputs"]["link"]["engine"] == "sm"
    assert default["traffic"]["nvlink_bytes"] == 0


def test_sglang_stack_per_mode(capsys):
    prefill = _json(capsys, [*V3_EP32, "--stack", "sglang"])
    decode = _json(capsys, [*V3_EP32, "--stack", "sglang", "--mode", "decode"])
    assert prefill["inputs"]["exchange"]["topology"] == "node"
    assert decode["inputs"]["exchange"]["topology"] == "pairs"
    assert (prefill["inputs"]["link"]["engine"], decode["inputs"]["link"]["engine"]) == (
        "sm", "copy",
    )  # fmt: skip
    assert decode["inputs"]["decode_attention"]["price"] == "roofline"
    jtbo = _json(capsys, V3_EP32)
    assert prefill["traffic"]["link_bytes"] < jtbo["traffic"]["link_bytes"]


def test_flags_replace_parts_of_a_stack(capsys):
    flat = _json(capsys, [*V3_EP32, "--stack", "sglang", "--topology", "flat"])
    assert flat["inputs"]["exchange"] == dict(
        dispatch_dtype="fp8", combine_dtype="bf16", topology="flat", gpus_per_node=None,
        nvlink_gbps=None,
    )  # fmt: skip
    measured = _json(
        capsys, [*V3_EP32, "--stack", "sglang", "--mode", "decode", "--decode-attention",
                 "measured"],
    )  # fmt: skip
    assert measured["inputs"]["decode_attention"] == dict(price="measured", gbps=None)
    node = _json(
        capsys, [*V3_EP32, "--topology", "node", "--gpus-per-node", "4", "--nvlink-gbps", "300"]
    )
    assert node["inputs"]["exchange"]["gpus_per_node"] == 4 and node["stack"] == "jtbo"


@pytest.mark.parametrize(
    "flags",
    [
        ["--topology", "node"],  # jtbo's stack has no node fields to keep
        ["--stack", "sglang", "--topology", "flat", "--gpus-per-node", "8"],
        ["--attention-gbps", "3000"],  # the measured kernel takes no rate
        ["--stack", "sglang", "--ep", "12"],  # not whole nodes of 8
        ["--stack", "sglang", "--nvlink-gbps", "0"],
    ],
)
def test_inconsistent_stack_flags_stop_at_parse(flags, capsys):
    with pytest.raises(SystemExit):
        predict.main(["--model", "deepseek_v3", *flags])
    assert "error" in capsys.readouterr().err


def test_summary_names_the_stack(capsys):
    predict.main([*V3_EP32, "--stack", "sglang"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("stack sglang: dispatch fp8, combine bf16, node exchange")


def test_host_ms_flag_replaces_the_tables_host_time(capsys):
    table = _json(capsys, V3_EP32)
    given = _json(capsys, [*V3_EP32, "--host-ms", "2.5"])
    assert table["inputs"]["host_ms"] is None and given["inputs"]["host_ms"] == 2.5
    runner = step_costs.load().table["runner_host"]["prefill"]  # the table's, per mode
    assert given["plain_ms"] - table["plain_ms"] == pytest.approx(2.5 - runner["plain_ms"])
    assert given["tbo_ms"] - table["tbo_ms"] == pytest.approx(2.5 - runner["tbo_ms"])


def test_expert_gemm_flags(capsys):
    bf16 = _json(capsys, V3_EP32)
    fp8 = _json(capsys, [*V3_EP32, "--expert-gemm-dtype", "fp8", "--fp8-speedup", "2"])
    assert bf16["inputs"]["expert_gemm"] == dict(dtype="bf16", fp8_speedup=None)
    assert fp8["inputs"]["expert_gemm"] == dict(dtype="fp8", fp8_speedup=2.0)
    assert (
        fp8["per_operation"]["experts"]["plain_ms"] < bf16["per_operation"]["experts"]["plain_ms"]
    )
    sglang = _json(capsys, [*V3_EP32, "--stack", "sglang"])["inputs"]["expert_gemm"]
    assert sglang["dtype"] == "fp8" and sglang["fp8_speedup"] > 1
    own = _json(capsys, [*V3_EP32, "--stack", "sglang", "--expert-gemm-dtype", "bf16"])
    assert own["inputs"]["expert_gemm"] == dict(dtype="bf16", fp8_speedup=None)
    for bad in (["--expert-gemm-dtype", "fp8"], ["--fp8-speedup", "2"]):
        with pytest.raises(SystemExit):
            predict.main([*V3_EP32, *bad])
