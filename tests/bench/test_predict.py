"""``python -m jtbo.bench predict`` on the shipped table (CPU, no compiles)."""

import json

import pytest

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
