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
