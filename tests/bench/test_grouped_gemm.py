"""CPU smoke test of ``python -m jtbo.bench grouped_gemm`` (tables and numerics, no timings)."""

import importlib.util

import numpy as np
import pytest

from jtbo.bench import grouped_gemm

SMALL = grouped_gemm.Shapes(hidden=64, ffn=32, experts=8, top_k=2)


def _table(text: str) -> list[list[str]]:
    """Cells of the final markdown table's data rows (after its header)."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("| T | impl |"))
    rows = [line for line in lines[start + 2 :] if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_small_run_prints_both_impls_with_small_errors(capsys):
    grouped_gemm.main(["--small", "--impls", "capacity,ragged_dot"])
    rows = _table(capsys.readouterr().out)
    assert [(r[0], r[1]) for r in rows] == [
        ("16", "capacity"),
        ("16", "ragged_dot"),
        ("64", "capacity"),
        ("64", "ragged_dot"),
    ]
    for row in rows:
        assert float(row[4]) > 0  # ms
        assert float(row[8]) < 2e-2, row  # rel err vs the float32 reference
    assert all(r[7] == "1.00" for r in rows if r[1] == "capacity")
    assert all(r[3] == "0" for r in rows if r[1] == "capacity")  # factor 4: nothing dropped


def test_pallas_and_dense_rows_with_ratios(capsys):
    grouped_gemm.main(
        ["--small", "--tokens", "16", "--impls", "capacity,dense,pallas:16x16x32w4s2"]
    )
    out = capsys.readouterr().out
    assert "kernel alone vs grouped_ffn_reference" in out
    rows = {r[1]: r for r in _table(out)}
    assert float(rows["pallas:16x16x32w4s2"][8]) < 2e-2  # rel err vs the float32 reference
    assert rows["dense"][8] == "-" and rows["dense"][9] == "1.00"  # the yardstick itself
    assert float(rows["pallas:16x16x32w4s2 (kernel)"][4]) > 0  # the kernel alone, timed
    for row in rows.values():
        assert float(row[9]) > 0 and float(row[10]) > 0 and float(row[11]) > 0


def test_pallas_spec_parses_per_kernel_configs():
    cfg = grouped_gemm.pallas_config("128x64x32w8s3/64x128x64g4")
    assert (cfg.gate_up.block_m, cfg.gate_up.block_n, cfg.gate_up.block_k) == (128, 64, 32)
    assert (cfg.gate_up.num_warps, cfg.gate_up.num_stages) == (8, 3)
    assert cfg.down.group_m == 4 and cfg.down.num_warps == 4  # default warps
    assert grouped_gemm.pallas_config("") is None
    with pytest.raises(ValueError, match="MxNxK"):
        grouped_gemm.pallas_config("64x64")


def test_mosaic_spec_parses_per_kernel_configs():
    cfg = grouped_gemm.mosaic_config("128x128x64s3/128x256x128t8")
    assert (cfg.gate_up.tile_m, cfg.gate_up.tile_n, cfg.gate_up.max_concurrent_steps) == (
        64,
        128,
        3,
    )
    assert (cfg.down.tile_n, cfg.down.tile_k, cfg.down.grid_tile_width) == (256, 128, 8)
    assert grouped_gemm.mosaic_config("") is None
    with pytest.raises(ValueError, match="MxNxK"):
        grouped_gemm.mosaic_config("127x64x64")


def test_the_mosaic_layer_row_is_checked_and_timed(capsys):
    # Two experts, one pick each: few tiles, so the interpreter runs the kernels quickly.
    flags = "--hidden 128 --ffn 128 --experts 2 --top-k 1 --tokens 16 --warmup 0 --iters 1"
    flags += " --reps 1 --impls dense,mosaic:128x64x64s2 --no-copy-ceiling"
    grouped_gemm.main(flags.split())
    rows = _table(capsys.readouterr().out)
    assert [r[1] for r in rows] == ["dense", "mosaic:128x64x64s2", "mosaic:128x64x64s2 (kernel)"]
    assert float(rows[1][8]) < 1e-2  # rel err against float32


def test_interleaved_timing_gives_one_median_per_case():
    calls = []

    def case(name):
        def fn():
            calls.append(name)
            return np.zeros(1)

        return fn, ()

    from jtbo.bench import device_rates

    seconds = device_rates.time_fns_interleaved([case("a"), case("b")], warmup=1, iters=2, reps=2)
    assert len(seconds) == 2 and all(t >= 0 for t in seconds)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 2  # warmup, then turns


def test_routing_is_distinct_and_skew_hits_expert_zero():
    ids, weights = grouped_gemm.route(200, SMALL, skew=0.5, seed=0)
    assert ids.shape == (200, 2) and ids.dtype == np.int32
    assert all(len(set(row)) == 2 for row in ids.tolist())
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)
    assert 80 < np.count_nonzero((ids == 0).any(axis=1)) < 150  # ~0.5 + 0.5 * 2/8 of tokens


def test_capacity_and_dropped_pairs():
    assert grouped_gemm.capacity_for(64, SMALL, 4.0) == 64
    ids = np.array([[0, 1], [0, 2], [0, 3]], np.int32)
    assert grouped_gemm.dropped_pairs(ids, 8, capacity=2) == 1


@pytest.mark.skipif(importlib.util.find_spec("tokamax") is not None, reason="tokamax installed")
def test_missing_tokamax_is_an_error_row_naming_the_wheel(capsys):
    with pytest.raises(SystemExit, match="tokamax"):
        grouped_gemm.main(["--small", "--tokens", "16", "--impls", "capacity,tokamax"])
    rows = _table(capsys.readouterr().out)
    assert rows[0][1] == "capacity" and float(rows[0][4]) > 0
    assert rows[1][1] == "tokamax" and grouped_gemm.TOKAMAX_WHEEL in rows[1][4]


def test_fp8_experts_run_the_layer_beside_the_dense_yardstick(capsys):
    # Weight-only FP8: the reference dequantizes the same weights, so the error stays that of
    # the bf16 tokens; a weight counts one byte. (The kernels' FP8 path is checked in
    # tests/kernels/test_grouped_gemm.py.)
    grouped_gemm.main(
        ["--small", "--tokens", "16", "--impls", "capacity,dense", "--expert-dtype",
         "float8_e4m3fn", "--no-copy-ceiling"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "top-2 bfloat16, experts float8_e4m3fn" in out
    rows = {r[1]: r for r in _table(out)}
    assert float(rows["capacity"][8]) < 2e-2, rows
    assert rows["dense"][9] == "1.00" and float(rows["capacity"][10]) > 0
    args = grouped_gemm._parse(["--expert-dtype", "float8_e4m3fn"])
    assert grouped_gemm.weight_itemsize(args) == 1
    assert grouped_gemm.weight_itemsize(grouped_gemm._parse([])) == 2
