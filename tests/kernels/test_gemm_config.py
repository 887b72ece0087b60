"""gemm_config: the default FP8 Mosaic launch shapes for an expert shape."""

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.kernels import gemm_config

_BASE = gemm_config.MOSAIC_FFN_FP8


def _expected(base: gemm_config.MosaicGemmConfig, contraction: int):
    """``base`` prefetching at the largest of 4, 3, 2 stages dividing its steps, by a search
    over the stage counts from the fewest up (None: the waited ``base``)."""
    steps = contraction // base.tile_k
    dividing = [stages for stages in (2, 3, 4) if steps % stages == 0]
    if not dividing:
        return base
    return dataclasses.replace(base, prefetch_across_tiles=True, max_concurrent_steps=max(dividing))


@settings(max_examples=40, deadline=None)
@given(hidden_blocks=st.integers(1, 64), ffn_blocks=st.integers(1, 128))
def test_fp8_default_prefetches_at_the_most_stages_dividing_each_kernels_steps(
    hidden_blocks, ffn_blocks
):
    hidden, ffn = 128 * hidden_blocks, 128 * ffn_blocks
    got = gemm_config.mosaic_ffn_fp8(hidden, ffn)
    registers = gemm_config.MOSAIC_FP8_GATE_UP_MEMORY_REGISTERS
    assert got.gate_up == dataclasses.replace(
        _expected(_BASE.gate_up, hidden), memory_registers=registers
    )
    assert got.down == _expected(_BASE.down, ffn)
    for cfg, contraction in ((got.gate_up, hidden), (got.down, ffn)):
        if cfg.prefetch_across_tiles:  # what the kernels require of a prefetching pipeline
            assert (contraction // cfg.tile_k) % cfg.max_concurrent_steps == 0


def test_fp8_defaults_of_the_presets():
    # Qwen3-30B-A3B: 16 gate / up steps in 4 stages, 6 down steps in 3; DeepSeek-V2-Lite's
    # 11 down steps have no divisor from 2 to 4, so its down kernel keeps the waited pipeline.
    qwen3 = gemm_config.mosaic_ffn_fp8(2048, 768)
    assert (qwen3.gate_up.prefetch_across_tiles, qwen3.gate_up.max_concurrent_steps) == (True, 4)
    assert (qwen3.down.prefetch_across_tiles, qwen3.down.max_concurrent_steps) == (True, 3)
    lite = gemm_config.mosaic_ffn_fp8(2048, 1408)
    assert lite.gate_up.prefetch_across_tiles and lite.down == _BASE.down


def test_the_default_for_float_weights_is_mosaic_ffn():
    assert gemm_config.default_mosaic_ffn(2048, 768, fp8=False) == gemm_config.MOSAIC_FFN
    fp8 = gemm_config.default_mosaic_ffn(2048, 768, fp8=True)
    assert fp8 == gemm_config.mosaic_ffn_fp8(2048, 768) != gemm_config.MOSAIC_FFN


@settings(max_examples=40, deadline=None)
@given(
    hidden_blocks=st.integers(1, 64),
    ffn_blocks=st.integers(1, 128),
    rows_per_expert=st.floats(0, 4 * gemm_config.MOSAIC_FP8_SPLIT_MAX_ROWS_PER_EXPERT),
)
def test_fp8_default_splits_the_columns_at_few_rows_an_expert_where_both_widths_split(
    hidden_blocks, ffn_blocks, rows_per_expert
):
    hidden, ffn = 128 * hidden_blocks, 128 * ffn_blocks
    got = gemm_config.mosaic_ffn_fp8(hidden, ffn, rows_per_expert)
    few = rows_per_expert <= gemm_config.MOSAIC_FP8_SPLIT_MAX_ROWS_PER_EXPERT
    split = few and hidden % 256 == 0 and ffn % 256 == 0
    if not split:
        assert got == gemm_config.mosaic_ffn_fp8(hidden, ffn)
        return
    assert got.gate_up.split_columns and got.down.split_columns
    assert got.gate_up.block_m == got.down.block_m == 64
    assert got.gate_up.block_n == got.down.block_n == 256
    assert got.gate_up.memory_registers == gemm_config.MOSAIC_FP8_GATE_UP_MEMORY_REGISTERS
    # Two gate / up stages at most: prefetching where they divide its steps, else waited.
    prefetching = (hidden // 128) % 2 == 0
    assert (got.gate_up.max_concurrent_steps, got.gate_up.prefetch_across_tiles) == (
        2,
        prefetching,
    )
    assert got.down == _expected(dataclasses.replace(_BASE.down, split_columns=True), ffn)


def test_fp8_decode_defaults_of_the_presets():
    # DeepSeek-V3 at 64 decode tokens (2 rows an expert): split, gate / up 56 steps in 2
    # stages, down 16 in 4; Mixtral-8x7B at 256 tokens (64 rows an expert): not split;
    # DeepSeek-V2-Lite's F = 1408 has no 256-column tiles: not split.
    dsv3 = gemm_config.default_mosaic_ffn(7168, 2048, fp8=True, rows_per_expert=2.0)
    assert dsv3.gate_up.describe() == "64x256x128 s2 t4 p c r88"
    assert dsv3.down.describe() == "64x256x128 s4 t4 p c"
    mixtral = gemm_config.default_mosaic_ffn(4096, 14336, fp8=True, rows_per_expert=64.0)
    assert mixtral == gemm_config.mosaic_ffn_fp8(4096, 14336)
    lite = gemm_config.default_mosaic_ffn(2048, 1408, fp8=True, rows_per_expert=2.0)
    assert lite == gemm_config.mosaic_ffn_fp8(2048, 1408)
    assert gemm_config.default_mosaic_ffn(7168, 2048, fp8=False, rows_per_expert=2.0) == (
        gemm_config.MOSAIC_FFN
    )
