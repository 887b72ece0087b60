"""``bench predict --measure``: measuring some of a table's sections into an existing one."""

import json

import jax
import pytest

from jtbo.analysis import step_costs
from jtbo.bench import predict, step_costs_measure


def test_measured_sections_are_the_tables():
    want = set(step_costs.SECTIONS + step_costs.OPTIONAL_SECTIONS)
    assert set(step_costs_measure.MEASURED) == want


def test_sections_measure_the_runners_host_time_into_an_existing_table(tmp_path, capsys):
    # stands for a small table measured before on this device
    table = dict(step_costs.load().table, small=True, device=jax.devices()[0].device_kind)
    table.pop("runner_host", None)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    predict.main(["--measure", "--small", "--out", str(path), "--sections", "runner_host"])
    got = json.loads(path.read_text())
    step_costs.check(got)
    for name in step_costs.SECTIONS:
        assert got[name] == table[name]  # kept as they were
    runner = got["runner_host"]
    assert runner["model"] == "tiny" and runner["devices"] == 1
    for mode, size in (("prefill", 64), ("decode", 8)):
        assert runner[mode]["tokens"] == size
        assert runner[mode]["plain_ms"] > 0 and runner[mode]["tbo_ms"] > 0
    assert set(got["dates"]) == {"runner_host"} and got["date"] == table["date"]
    assert "wrote" in capsys.readouterr().out


def test_sections_need_an_existing_table_and_known_names(tmp_path):
    missing = str(tmp_path / "none.json")
    with pytest.raises(SystemExit):
        predict.main(["--measure", "--out", missing, "--sections", "runner_host"])
    with pytest.raises(SystemExit):
        predict.main(["--measure", "--out", missing, "--sections", "host"])
    with pytest.raises(ValueError, match="small=False"):
        step_costs_measure.measure(True, only=["host_ms"], into=dict(small=False))
    with pytest.raises(ValueError, match="is of a NVIDIA H200"):
        step_costs_measure.measure(True, only=["host_ms"], into=dict(device="NVIDIA H200"))
