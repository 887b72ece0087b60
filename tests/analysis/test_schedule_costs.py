"""Pricing a compiled module's instructions and collective windows (``schedule_costs``)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.analysis import schedule_costs

MODEL = schedule_costs.CostModel(
    matmul_flops_per_s=1e12, memory_bytes_per_s=1e9, launch_us=1.0,
    link_bytes_per_s=1e9, collective_launch_us=10.0, unknown_trip_count=3,
)  # fmt: skip


def _module(m: int, k: int, n: int, exchange_rows: int, with_b_matmul: bool) -> str:
    """A scheduled module: A issues an all-to-all, B's matmul (a gemm fusion) runs inside."""
    inside = (
        f"  %gemm_b = f32[{m},{n}]{{1,0}} fusion(%lhs, %rhs), kind=kCustom, calls=%gemm, "
        'metadata={op_name="jit(f)/tbo_b/L0.experts/dot_general"}\n'
        if with_b_matmul
        else ""
    )
    return (
        f"%gemm (p0: f32[{m},{k}], p1: f32[{k},{n}]) -> f32[{m},{n}] {{\n"
        f"  %p0 = f32[{m},{k}]{{1,0}} parameter(0)\n"
        f"  %p1 = f32[{k},{n}]{{1,0}} parameter(1)\n"
        f"  ROOT %d = f32[{m},{n}]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, "
        "rhs_contracting_dims={0}\n"
        "}\n\n"
        "ENTRY %main () -> f32[1] {\n"
        f"  %lhs = f32[{m},{k}]{{1,0}} parameter(0)\n"
        f"  %rhs = f32[{k},{n}]{{1,0}} parameter(1)\n"
        f"  %x = f32[{exchange_rows},256]{{1,0}} parameter(2)\n"
        f"  %a2a = (f32[{exchange_rows},256]{{1,0}}) all-to-all-start(%x), dimensions={{0}}, "
        'metadata={op_name="jit(f)/tbo_a/L0.dispatch_a/all_to_all"}\n'
        + inside
        + f"  %a2a-done = f32[{exchange_rows},256]{{1,0}} all-to-all-done(%a2a), "
        'metadata={op_name="jit(f)/tbo_a/L0.dispatch_a/all_to_all"}\n'
        "  ROOT %r = f32[1]{0} constant({0})\n"
        "}\n"
    )


@settings(max_examples=20, deadline=None)
@given(
    m=st.integers(1, 512), k=st.integers(1, 512), n=st.integers(1, 512),
    rows=st.integers(1, 4096),
)  # fmt: skip
def test_window_fill_prices_the_other_micro_batchs_matmul(m, k, n, rows):
    (fill,) = schedule_costs.window_fill(_module(m, k, n, rows, True), MODEL)
    flops, moved = 2.0 * m * k * n, 4.0 * (m * k + k * n + m * n)
    matmul_us = 1.0 + max(flops / 1e12, moved / 1e9) * 1e6
    exchange_us = 10.0 + rows * 256 * 4 / 1e9 * 1e6
    assert fill.kind == "all-to-all" and fill.micro_batch == "tbo_a"
    assert fill.num_bytes == rows * 256 * 4
    assert fill.exchange_us == pytest.approx(exchange_us)
    assert fill.compute_us == pytest.approx(matmul_us)
    assert fill.other_micro_batch_us == pytest.approx(matmul_us)
    assert fill.fill == pytest.approx(matmul_us / exchange_us)


def test_an_empty_window_has_fill_zero():
    (fill,) = schedule_costs.window_fill(_module(64, 64, 64, 1024, False), MODEL)
    assert fill.compute_us == 0 and fill.fill == 0


def _loop_module(trip_count: str) -> str:
    config = f', backend_config={{"known_trip_count":{{"n":"{trip_count}"}}}}' if trip_count else ""
    return (
        "%body (p: f32[1024]) -> f32[1024] {\n"
        "  %p = f32[1024]{0} parameter(0)\n"
        "  ROOT %e = f32[1024]{0} fusion(%p), kind=kLoop, calls=%exp\n"
        "}\n\n"
        "%cond (q: f32[1024]) -> pred[] {\n"
        "  %q = f32[1024]{0} parameter(0)\n"
        "  ROOT %c = pred[] constant(true)\n"
        "}\n\n"
        "ENTRY %main () -> f32[1] {\n"
        "  %x = f32[8,256]{1,0} parameter(0)\n"
        "  %y = f32[1024]{0} parameter(1)\n"
        "  %a2a = (f32[8,256]{1,0}) all-to-all-start(%x), dimensions={0}, "
        'metadata={op_name="jit(f)/tbo_a/L0.dispatch_a/all_to_all"}\n'
        "  %w = f32[1024]{0} while(%y), condition=%cond, body=%body, "
        f'metadata={{op_name="jit(f)/tbo_b/L0.attn_core/while"}}{config}\n'
        "  %a2a-done = f32[8,256]{1,0} all-to-all-done(%a2a)\n"
        "  ROOT %r = f32[1]{0} constant({0})\n"
        "}\n"
    )


@pytest.mark.parametrize("trip_count, trips", [("5", 5), ("", 3)])
def test_a_loop_costs_its_body_times_its_trip_count(trip_count, trips):
    (fill,) = schedule_costs.window_fill(_loop_module(trip_count), MODEL)
    body_us = 1.0 + 2 * 1024 * 4 / 1e9 * 1e6  # one fusion reading and writing f32[1024]
    assert fill.other_micro_batch_us == pytest.approx(trips * body_us)
