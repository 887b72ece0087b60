"""The shipped cost table's schema and the interpolation rules."""

import copy

import pytest

from jtbo.analysis import step_costs


def test_shipped_table_passes_its_schema():
    costs = step_costs.load()
    assert costs.table["device"] == "NVIDIA H200" and not costs.table["small"]
    assert costs.dense_gemm(100, 7168, 2048) > 0 and costs.host_ms >= 0
    assert costs.slowdown("sm") >= 1 and costs.slowdown("copy") >= 1


def test_check_names_a_bad_curve():
    table = copy.deepcopy(step_costs.load().table)
    table["dense_gemm"][0]["rows"] = list(reversed(table["dense_gemm"][0]["rows"]))
    with pytest.raises(ValueError, match="not increasing"):
        step_costs.check(table)
    del table["slowdown"]
    with pytest.raises(ValueError, match="lacks sections"):
        step_costs.check(table)


def test_interpolate_floor_inside_and_linear_above():
    xs, ys = [1.0, 100.0], [1.0, 10.0]
    assert step_costs.interpolate(xs, ys, 0.5) == 1.0
    assert step_costs.interpolate(xs, ys, 10.0) == pytest.approx(10**0.5)
    assert step_costs.interpolate(xs, ys, 200.0) == pytest.approx(20.0)
