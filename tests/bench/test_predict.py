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
