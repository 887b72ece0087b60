"""CPU smoke test of ``python -m jtbo.bench grouped_gemm`` (tables and numerics, no timings)."""

import dataclasses
import functools
import importlib.util
import re
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.bench import grouped_gemm
from jtbo.kernels import fp8_blocks
from jtbo.models import config as config_lib
from jtbo.models import experts

SMALL = grouped_gemm.Shapes(hidden=64, ffn=32, experts=8, top_k=2)


def _table(text: str) -> list[list[str]]:
    """Cells of the final markdown table's data rows (after its header)."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("| T | impl |"))
    rows = [line for line in lines[start + 2 :] if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_small_run_prints_both_impls_with_small_errors(capsys):
    grouped_gemm.main(["--small", "--impls", "capacity,ragged_dot", "--kernel-time"])
    out = capsys.readouterr().out
    rows = _table(out)
    # --kernel-time traced each row; the CPU's trace holds no GPU kernels.
    for tokens in (16, 64):
        for impl in ("capacity", "ragged_dot"):
            assert f"T={tokens} {impl}: no compute kernels in the trace" in out
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


def test_no_kernel_rows_leaves_out_the_kernel_alone_but_checks_the_layer(capsys):
    grouped_gemm.main(
        ["--small", "--tokens", "16", "--impls", "pallas:16x16x32w4s2", "--no-kernel-rows"]
    )
    out = capsys.readouterr().out
    assert "kernel alone vs grouped_ffn_reference" in out  # the check before timing stays
    rows = _table(out)
    assert [r[1] for r in rows] == ["pallas:16x16x32w4s2"]
    assert float(rows[0][8]) < 2e-2 and float(rows[0][4]) > 0


def test_layers_per_call_times_a_stack_and_says_so(capsys):
    grouped_gemm.main(
        ["--small", "--tokens", "16", "--impls", "dense,capacity", "--layers-per-call", "2"]
    )
    out = capsys.readouterr().out
    assert "2 layers a call (times per layer)" in out
    rows = {r[1]: r for r in _table(out)}
    assert float(rows["capacity"][8]) < 2e-2  # the checked layer is the first one alone
    assert float(rows["capacity"][4]) > 0 and float(rows["dense"][4]) > 0


def test_a_stack_runs_each_layer_with_its_own_routing_on_the_residual_rows():
    # Against a loop over the exact reference layer: layer i takes routing i, and each adds
    # its output to the rows it was given.
    args = types.SimpleNamespace(shapes=SMALL, skew=0.0, seed=0, layers_per_call=3)
    ids_np, routing_np = grouped_gemm.route(24, SMALL, 0.0, 5)
    ids, routing = jnp.asarray(ids_np), jnp.asarray(routing_np)
    layer_ids, layer_routing = grouped_gemm.layer_routes(ids, routing, args)
    assert layer_ids.shape == (3, 24, 2)
    np.testing.assert_array_equal(layer_ids[0], ids)
    assert not np.array_equal(layer_ids[1], layer_ids[2])
    x, weights = grouped_gemm.make_inputs(24, SMALL, jnp.float32, jax.random.key(2))
    layer = grouped_gemm.layer_body("capacity", SMALL, capacity=24)
    got = jax.jit(grouped_gemm.stacked(layer))(x, layer_ids, layer_routing, weights)
    want = x
    for i in range(3):
        want = want + experts.experts_ragged_dot_reference(
            want, layer_ids[i], layer_routing[i], weights
        )
    chex.assert_trees_all_close(got, want, atol=1e-4, rtol=1e-4)


def test_pallas_spec_parses_per_kernel_configs():
    cfg = grouped_gemm.pallas_config("128x64x32w8s3/64x128x64g4")
    assert (cfg.gate_up.block_m, cfg.gate_up.block_n, cfg.gate_up.block_k) == (128, 64, 32)
    assert (cfg.gate_up.num_warps, cfg.gate_up.num_stages) == (8, 3)
    assert cfg.down.group_m == 4 and cfg.down.num_warps == 4  # default warps
    assert grouped_gemm.pallas_config("") is None
    with pytest.raises(ValueError, match="MxNxK"):
        grouped_gemm.pallas_config("64x64")


def test_mosaic_spec_parses_per_kernel_configs():
    cfg = grouped_gemm.mosaic_config("128x128x64s3f1/128x256x128t8p")
    assert (cfg.gate_up.tile_m, cfg.gate_up.tile_n, cfg.gate_up.max_concurrent_steps) == (
        64,
        128,
        3,
    )
    assert (cfg.down.tile_n, cfg.down.tile_k, cfg.down.grid_tile_width) == (256, 128, 8)
    assert (cfg.gate_up.wgmma_in_flight, cfg.down.wgmma_in_flight) == (1, 0)
    assert (cfg.gate_up.prefetch_across_tiles, cfg.down.prefetch_across_tiles) == (False, True)
    assert grouped_gemm.mosaic_config("") is None
    registers = grouped_gemm.mosaic_config("128x128x128s4pr104/128x128x128r72")
    assert (registers.gate_up.memory_registers, registers.down.memory_registers) == (104, 72)
    assert registers.gate_up.prefetch_across_tiles and registers.gate_up.block_m == 128
    split = grouped_gemm.mosaic_config("64x256x128s2pc/64x256x128s4c")
    assert (split.gate_up.tile_m, split.gate_up.tile_n, split.gate_up.block_m) == (64, 128, 64)
    assert split.gate_up.split_columns and split.down.split_columns
    assert (split.gate_up.block_n, split.down.max_concurrent_steps) == (256, 4)
    assert split.gate_up.describe() == "64x256x128 s2 t4 p c"
    # M odd (N with c); letters no option takes (w, m and e among them): the message gives the
    # grammar.
    refused = ("127x64x64", "128x255x64c", "128x256x64s4pw", "128x256x64pe/128x256x64cm")
    refused += ("128x256x64m", "128x128x64s4f1m/128x256x64pm")
    refused += ("128x128x128s4e", "128x128x128s4pe", "128x128x128s4er104/128x128x128r72")
    grammar = re.escape("expected MxNxK[sS][tT][fF][p][c][rR] with M even (N with c)")
    for spec in refused:
        with pytest.raises(ValueError, match=grammar):
            grouped_gemm.mosaic_config(spec)


def test_the_mosaic_layer_row_is_checked_and_timed(capsys):
    # Two experts, one pick each: few tiles, so the interpreter runs the kernels quickly.
    flags = "--hidden 128 --ffn 128 --experts 2 --top-k 1 --tokens 16 --warmup 0 --iters 1"
    flags += " --reps 1 --impls dense,mosaic:128x64x64s2 --no-copy-ceiling"
    grouped_gemm.main(flags.split())
    rows = _table(capsys.readouterr().out)
    assert [r[1] for r in rows] == ["dense", "mosaic:128x64x64s2", "mosaic:128x64x64s2 (kernel)"]
    assert float(rows[1][8]) < 1e-2  # rel err against float32
    # Computed TF/s counts both experts' one 128-row tile each: 256 rows for 16 pairs.
    for row in rows[1:]:
        assert float(row[6]) / float(row[5]) == pytest.approx(16, rel=1e-3)


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


def test_computed_rows_round_each_experts_rows_up_to_the_mosaic_row_tile():
    # Expert counts 130, 0, 5 and (clipped to the capacity 150) 150 over 4 experts.
    ids = np.repeat([0, 2, 3], [130, 5, 200]).astype(np.int32)[:, None]
    four_experts = dataclasses.replace(SMALL, experts=4)
    rows = functools.partial(grouped_gemm.computed_rows, ids=ids, shapes=four_experts, capacity=150)
    assert rows("capacity", fp8=False) == 4 * 150
    assert rows("pallas", fp8=False) == rows("dense", fp8=False) == 335
    assert rows("mosaic", fp8=False) == rows("mosaic", fp8=True) == (2 + 1 + 2) * 128
    # A spec's row tile: 256 rows.
    assert rows("mosaic:256x128x64/256x256x64", fp8=False) == (1 + 1 + 1) * 256


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


def test_a_preset_sets_the_expert_shape():
    args = grouped_gemm._parse(["--preset", "qwen3-235b-a22b", "--tokens", "128"])
    assert args.shapes == grouped_gemm.Shapes(hidden=4096, ffn=1536, experts=128, top_k=8)
    assert args.preset == "qwen3-235b-a22b"


@pytest.mark.parametrize(
    "extra", [["--hidden", "2048"], ["--ffn", "1"], ["--experts", "8"], ["--top-k", "2"]]
)
def test_a_size_flag_beside_a_preset_is_an_error_naming_both(extra, capsys):
    with pytest.raises(SystemExit) as exit_info:
        grouped_gemm._parse(["--preset", "deepseek-v3", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--preset deepseek-v3" in err and extra[0] in err


def test_small_beside_a_preset_is_an_error(capsys):
    with pytest.raises(SystemExit):
        grouped_gemm._parse(["--small", "--preset", "mixtral-8x7b"])
    assert "--preset mixtral-8x7b" in capsys.readouterr().err


def test_an_unknown_preset_is_refused_with_the_names(capsys):
    with pytest.raises(SystemExit):
        grouped_gemm._parse(["--preset", "qwen3"])
    err = capsys.readouterr().err
    assert "invalid choice: 'qwen3'" in err and "qwen3-30b-a3b" in err


def test_without_a_preset_each_size_left_out_takes_the_default():
    cfg = config_lib.MoEConfig.deepseek_v3_reduced()
    default = grouped_gemm.Shapes(
        cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    )
    assert grouped_gemm._parse([]).shapes == default
    got = grouped_gemm._parse(["--experts", "16"]).shapes
    assert got == grouped_gemm.Shapes(default.hidden, default.ffn, 16, default.top_k)
    small = grouped_gemm._parse(["--small", "--top-k", "1"]).shapes
    assert small == grouped_gemm.Shapes(64, 32, 8, 1)  # --small's sizes, the flag wins


def _swiglu_reference_f64(x, ids, routing, weights) -> np.ndarray:
    """Each token's routed SwiGLU sum in float64 numpy, expert by expert."""
    gate_up, down = (np.asarray(w, np.float64) for w in weights)
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(ids[t]), np.asarray(routing[t]), strict=True):
            gate, up = x[t] @ gate_up[e, :, 0], x[t] @ gate_up[e, :, 1]
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return out


def test_the_chunked_reference_equals_float64_over_every_expert():
    # The reference casts only each chunk's experts to float32 (ids renumbered to them): it
    # must still be the layer over the full expert set.
    num_tokens = 21
    ids, routing = grouped_gemm.route(num_tokens, SMALL, 0.3, seed=4)
    x, weights = grouped_gemm.make_inputs(num_tokens, SMALL, np.float32, jax.random.key(2))
    rows = grouped_gemm.check_rows(num_tokens, 13)
    got = grouped_gemm.reference(x, np.asarray(ids), np.asarray(routing), weights, rows)
    want = _swiglu_reference_f64(np.asarray(x)[rows], ids[rows], routing[rows], weights)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("draw_experts", [32, 3])  # one draw; three of 3, 3 and 2 experts
def test_fp8_inputs_are_stored_contraction_last_and_the_reference_dequantizes_them(
    draw_experts, monkeypatch
):
    monkeypatch.setattr(grouped_gemm, "DRAW_EXPERTS", draw_experts)
    num_tokens = 9
    ids, routing = grouped_gemm.route(num_tokens, SMALL, 0.3, seed=5)
    x, weights = grouped_gemm.make_inputs(
        num_tokens, SMALL, np.float32, jax.random.key(3), expert_dtype="float8_e4m3fn"
    )
    h, f, e = SMALL.hidden, SMALL.ffn, SMALL.experts
    assert [w.values.shape for w in weights] == [(e, 2, f, h), (e, h, f)]
    assert [w.shape for w in weights] == [(e, h, 2, f), (e, f, h)]
    # The weights' own order by the block-by-block definition, each stored axis moved back.
    logical = [
        fp8_blocks.dequantize_blocks_reference(
            np.moveaxis(np.asarray(w.values), -1, 1), np.moveaxis(np.asarray(w.scales), -1, 1),
            w.block_shape,
        )
        for w in weights
    ]  # fmt: skip
    # Every expert its own draw, normal over sqrt(fan-in), whichever draw it came from.
    for weight, fan_in in zip(logical, (h, f), strict=True):
        per_expert = weight.reshape(e, -1)
        np.testing.assert_allclose(per_expert.std(axis=1), fan_in**-0.5, rtol=0.25)
        assert len({expert.tobytes() for expert in per_expert}) == e
    rows = grouped_gemm.check_rows(num_tokens, 9)
    got = grouped_gemm.reference(x, np.asarray(ids), np.asarray(routing), weights, rows)
    want = _swiglu_reference_f64(np.asarray(x)[rows], ids[rows], routing[rows], logical)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("draw_experts", [32, 3])
def test_bf16_inputs_are_drawn_in_chunks_and_cast(draw_experts, monkeypatch):
    # The bf16 weights are drawn and cast DRAW_EXPERTS experts at a time (DeepSeek-V3's
    # float32 draws do not fit an H100 whole): each expert still its own normal draw over
    # sqrt(fan-in), in bf16, and the draws are the float32 draws cast.
    monkeypatch.setattr(grouped_gemm, "DRAW_EXPERTS", draw_experts)
    key = jax.random.key(6)
    _, weights = grouped_gemm.make_inputs(5, SMALL, jnp.bfloat16, key)
    h, f, e = SMALL.hidden, SMALL.ffn, SMALL.experts
    assert [(w.shape, w.dtype) for w in weights] == [
        ((e, h, 2, f), jnp.bfloat16), ((e, f, h), jnp.bfloat16)
    ]  # fmt: skip
    for weight, fan_in in zip(weights, (h, f), strict=True):
        per_expert = np.asarray(weight, np.float32).reshape(e, -1)
        np.testing.assert_allclose(per_expert.std(axis=1), fan_in**-0.5, rtol=0.25)
        assert len({expert.tobytes() for expert in per_expert}) == e
    # The first chunk's experts are the float32 draw of its key, cast.
    k_gu = jax.random.split(key, 3)[1]
    first = min(draw_experts, e)
    draw = jax.random.normal(jax.random.fold_in(k_gu, 0), (first, h, 2, f)) / np.sqrt(h)
    np.testing.assert_array_equal(
        np.asarray(weights[0][:first], np.float32),
        np.asarray(draw.astype(jnp.bfloat16), np.float32),
    )


def test_fp8_experts_run_the_layer_beside_the_dense_yardstick(capsys):
    # The reference dequantizes the same weights and puts the rows through the same FP8
    # rounding as the capacity layer (FP8 activations), so the error stays that of the bf16
    # tokens; a weight counts one byte. (The kernels' FP8 path is checked in
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


def test_weight_only_variants_parse_and_pick_their_reference():
    assert grouped_gemm.kernel_variant("") == ("", True)
    assert grouped_gemm.kernel_variant("64x64x64") == ("64x64x64", True)
    assert grouped_gemm.kernel_variant("weight_only") == ("", False)
    assert grouped_gemm.kernel_variant("weight_only:16x128x128w4s3") == ("16x128x128w4s3", False)
    options = grouped_gemm.kernel_options("pallas", "weight_only:16x128x128w4s3")
    assert options["fp8_activations"] is False and options["config"].gate_up.block_k == 128
    assert grouped_gemm.kernel_options("pallas", "")["config"] is None
    rows = {impl: grouped_gemm.fp8_rows(impl) for impl in ("capacity", "pallas", "ragged_dot")}
    assert rows == {"capacity": True, "pallas": True, "ragged_dot": False}
    assert not grouped_gemm.fp8_rows("pallas:weight_only")
