"""The shipped cost table's schema and the interpolation rules."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_runner_host_is_optional_and_checked():
    table = copy.deepcopy(step_costs.load().table)
    table.pop("runner_host", None)
    bare = step_costs.StepCosts(table)
    assert bare.step_host_ms("decode", True) == bare.host_ms  # the round trip stands for it
    table["runner_host"] = dict(
        prefill=dict(tokens=4096, plain_ms=1.5, tbo_ms=2.5),
        decode=dict(tokens=128, plain_ms=1.25, tbo_ms=1.75),
    )
    step_costs.check(table)
    runner = step_costs.StepCosts(table)
    assert runner.step_host_ms("prefill", False) == 1.5
    assert runner.step_host_ms("prefill", True) == 2.5
    assert runner.step_host_ms("decode", True) == 1.75
    table["runner_host"]["decode"]["tbo_ms"] = -1.0
    with pytest.raises(ValueError, match="runner_host decode"):
        step_costs.check(table)


def test_interpolate_floor_inside_and_linear_above():
    xs, ys = [1.0, 100.0], [1.0, 10.0]
    assert step_costs.interpolate(xs, ys, 0.5) == 1.0
    assert step_costs.interpolate(xs, ys, 10.0) == pytest.approx(10**0.5)
    assert step_costs.interpolate(xs, ys, 200.0) == pytest.approx(20.0)


@given(st.sampled_from([16, 64, 256, 1024, 4096, 16384, 3000]), st.sampled_from([7168, 2048]))
def test_dense_gemm_grows_with_its_weight(rows, k):
    # between measured weight shapes the time is interpolated, not the nearest shape's time
    # scaled (which jumps down where the nearest shape changes, its floor scaled with it)
    costs = step_costs.load()
    widths = [int(64 * 1.1**i) for i in range(60)]
    times = [costs.dense_gemm(rows, k, n) for n in widths]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(times, times[1:], strict=False))
    for curve in costs.table["dense_gemm"]:
        measured = step_costs.interpolate(curve["rows"], curve["ms"], rows)
        assert costs.dense_gemm(rows, curve["k"], curve["n"]) == pytest.approx(measured)


@given(st.sampled_from(step_costs.ROWWISE_OPS), st.floats(1.0, 1e5), st.integers(1, 70000))
def test_rowwise_prices_bytes_and_keeps_the_floor(op, rows, width):
    costs = step_costs.load()
    section = costs.table["rowwise"]
    measured = section["routing_experts"] if op == "routing" else section["hidden"]
    assert costs.rowwise(op, rows, width) == pytest.approx(
        costs.rowwise(op, rows * width / measured, measured)
    )
    assert costs.rowwise(op, rows, width) >= min(section[op]) * (1 - 1e-12)


@settings(max_examples=40, deadline=None)
@given(
    st.floats(1.0, 1e6), st.sampled_from([1, 4, 8, 32, 64]), st.floats(1.0, 4.0),
    st.floats(0.3, 1.0),
)  # fmt: skip
def test_fp8_expert_gemm_is_never_slower_than_bf16(rows, experts, speedup, byte_ratio):
    costs = step_costs.load()
    bf16 = costs.grouped_gemm(rows, experts, 7168, 2048)
    fp8 = costs.grouped_gemm_fp8(rows, experts, 7168, 2048, speedup, byte_ratio)
    assert 0 < fp8 <= bf16 * (1 + 1e-12)
    assert fp8 >= bf16 * min(byte_ratio, 1 / speedup) * (1 - 1e-12)


@pytest.mark.parametrize("speedup", [1.0, 1.5, 2.0])
def test_fp8_expert_gemm_scales_bytes_where_weight_bound_and_rate_where_compute_bound(speedup):
    costs, ratio = step_costs.load(), 0.5
    weight_bound = 32 * 8  # 8 rows per expert, under the smallest measured size
    compute_bound = 32 * 65536  # past the largest measured size
    for rows, scale in ((weight_bound, ratio), (compute_bound, 1 / speedup)):
        bf16 = costs.grouped_gemm(rows, 32, 7168, 2048)
        fp8 = costs.grouped_gemm_fp8(rows, 32, 7168, 2048, speedup, ratio)
        assert fp8 == pytest.approx(bf16 * scale)
    with pytest.raises(ValueError, match="speedup"):
        costs.grouped_gemm_fp8(64, 32, 7168, 2048, 0.5, ratio)
