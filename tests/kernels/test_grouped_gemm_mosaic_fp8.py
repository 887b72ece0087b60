"""grouped_ffn(impl="mosaic") with FP8 weights and FP8 activations: the Mosaic GPU kernels
(Mosaic GPU's interpreter on the CPU) against a float64 numpy reference of the scheme, the
Pallas FP8 kernels, and the refusals.

Cases: an empty expert, a full one, partial last tiles, a capacity that is not a multiple of
the row tile, slot rows loaded through an index; 64 x 64 blocks (two contraction steps and a
cluster's two column tiles on small shapes) and the default 128 x 128 blocks.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo import aot, kernels
from jtbo.kernels import (
    fp8_blocks,
    gemm_config,
    grouped_gemm,
    grouped_gemm_mosaic,
    grouped_gemm_mosaic_fp8,
    slot_rows,
)
from jtbo.models import experts
from tests.kernels import helpers

E, C = 3, 200
SMALL_BLOCK = (64, 64)
SMALL = gemm_config.MosaicFfnConfig(
    gate_up=gemm_config.MosaicGemmConfig(tile_n=64, tile_k=64, max_concurrent_steps=2),
    down=gemm_config.MosaicGemmConfig(tile_n=64, tile_k=64, max_concurrent_steps=2),
)
PREFETCHING = helpers.both_kernels(SMALL, prefetch_across_tiles=True)
# The warpgroups side by side over a 128-column tile of two 64-wide blocks, 64-row tiles.
SPLIT_COLUMNS = helpers.both_kernels(PREFETCHING, split_columns=True)
# (H, F, block, config): two contraction steps of each kernel, one cluster's column pair in
# the gate / up kernel and two in the down kernel.
CASES = {
    "64-blocks": (128, 128, SMALL_BLOCK, SMALL),
    # The default launch shapes (config None: gemm_config.mosaic_ffn_fp8, prefetching across
    # tiles, 2 contraction steps in 2 stages).
    "128-blocks": (256, 256, (128, 128), None),
    # One pipeline over each CTA's tiles: four live tiles over the interpreter's two clusters,
    # a pipeline of four visits a cluster in the gate / up kernel (two column pairs a tile),
    # of two in the down kernel.
    "prefetching": (128, 256, SMALL_BLOCK, PREFETCHING),
    # The same with the warpgroups splitting the columns: 64-row tiles (four and five live
    # tiles of the two experts), each warpgroup its own weight block and scale; the down
    # kernel's one 128-column tile walked by each CTA alone (an odd number of column tiles).
    "split-columns": (128, 256, SMALL_BLOCK, SPLIT_COLUMNS),
}
# As the Pallas FP8 kernels' test: the rows are quantized bit for bit, the hidden rows summed
# in another order, so a hidden value on a rounding boundary may land on its neighbour.
FP8_ACTIVATIONS_TOL = 5e-3  # of the output's norm
ON_CPU = jax.default_backend() == "cpu"
DTYPE = jnp.float32 if ON_CPU else jnp.bfloat16  # the GPU kernels read 16-bit rows


def _within(got, want, dtype) -> None:
    got = np.asarray(got, np.float64)
    bf16_rounding = 0 if dtype == jnp.float32 else 2**-8  # the output's own dtype
    tol = FP8_ACTIVATIONS_TOL + bf16_rounding
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


@functools.cache
def _slot_buffer_case(hidden: int, ffn: int, block: tuple[int, int]):
    """``(w_gate_up, w_down, x, counts, numpy reference, Pallas FP8 output)`` of the slot
    buffer test at one shape, built once: the launch shapes of one shape share them."""
    (w_gate_up, gate_up_64), (w_down, down_64) = helpers.fp8_expert_weights(
        1, (E, hidden, ffn), block
    )
    counts = np.array([130, 0, C], np.int32)  # a partial second tile, empty, full
    x = jnp.asarray(np.random.default_rng(2).standard_normal((E, C, hidden)) * 3, DTYPE)
    want = helpers.numpy_fp8_activations_ffn(x, counts, gate_up_64, down_64, block[0])
    pallas = kernels.grouped_ffn(x, jnp.asarray(counts), w_gate_up, w_down, impl="pallas")
    return w_gate_up, w_down, x, counts, want, np.asarray(pallas)


@pytest.mark.parametrize("case", CASES)
def test_slot_buffer_matches_the_numpy_scheme_and_zeros_the_padding(case):
    hidden, ffn, block, config = CASES[case]
    w_gate_up, w_down, x, counts, want, pallas = _slot_buffer_case(hidden, ffn, block)
    out = kernels.grouped_ffn(
        x, jnp.asarray(counts), w_gate_up, w_down, impl="mosaic", config=config
    )
    assert out.dtype == DTYPE
    _within(out, want, DTYPE)
    got = np.asarray(out, np.float64)
    assert not got[0, 130:].any() and not got[1].any()
    assert (np.abs(got[0, :130]).max(axis=-1) > 0).all()
    # The same scheme as the Pallas kernels: on the interpreter, the same float32 arithmetic
    # up to its order of summation (which the CPU's code generation can change), far inside
    # the FP8 rounding that a different quantization would show.
    if ON_CPU:
        scale = float(np.abs(pallas).max())
        np.testing.assert_allclose(np.asarray(out), pallas, rtol=0, atol=1e-6 * scale)


def test_slot_rows_load_through_the_index():
    hidden, ffn, block, config = CASES["64-blocks"]
    (w_gate_up, gate_up_64), (w_down, down_64) = helpers.fp8_expert_weights(
        3, (E, hidden, ffn), block
    )
    rows = jnp.asarray(np.random.default_rng(4).standard_normal((50, hidden)), jnp.bfloat16)
    slot_row = np.full((E, C), -1, np.int32)
    slot_row[0, :7] = np.arange(7)
    slot_row[2, :140] = np.random.default_rng(5).integers(0, 50, 140)
    slot_row[2, 3] = -1  # an empty slot among the live ones
    slots = kernels.SlotRows(rows, jnp.asarray(slot_row))
    counts = np.array([7, 0, 140], np.int32)
    got = grouped_gemm.grouped_ffn_rows(
        slots, jnp.asarray(counts), w_gate_up, w_down, impl="mosaic", config=config, max_rows=147
    )
    assert isinstance(got, kernels.SlotRows)
    x = np.asarray(slots.materialize(), np.float32)
    want = helpers.numpy_fp8_activations_ffn(x, counts, gate_up_64, down_64, block[0])
    _within(got.materialize(), want, jnp.bfloat16)


def test_weight_only_fp8_and_other_tiles_are_refused():
    hidden, ffn, block, _ = CASES["64-blocks"]
    (w_gate_up, _), (w_down, _) = helpers.fp8_expert_weights(0, (E, hidden, ffn), block)
    x, counts = jnp.ones((E, 8, hidden), DTYPE), jnp.ones((E,), jnp.int32)
    call = functools.partial(kernels.grouped_ffn, x, counts, w_gate_up, w_down, impl="mosaic")
    with pytest.raises(ValueError, match="FP8 rows only.*impl='pallas'"):
        call(config=SMALL, fp8_activations=False)
    with pytest.raises(kernels.KernelUnavailableError, match="one 64 x 64 weight block"):
        call(config=gemm_config.MOSAIC_FFN_FP8)  # 128-wide steps over 64-wide blocks
    in_flight = dataclasses.replace(SMALL.down, wgmma_in_flight=1)
    with pytest.raises(kernels.KernelUnavailableError, match="wgmma_in_flight must be 0"):
        call(config=dataclasses.replace(SMALL, down=in_flight))
    prefetching = dataclasses.replace(
        SMALL.down, prefetch_across_tiles=True, max_concurrent_steps=3
    )
    with pytest.raises(kernels.KernelUnavailableError, match=r"contraction steps \(2\)"):
        call(config=dataclasses.replace(SMALL, down=prefetching))  # two steps, three stages
    (w_gate_up, _), (w_down, _) = helpers.fp8_expert_weights(0, (E, hidden, 160), block)
    with pytest.raises(kernels.KernelUnavailableError, match="tiles 160 columns by 64"):
        kernels.grouped_ffn(x, counts, w_gate_up, w_down, impl="mosaic", config=SMALL)


@pytest.mark.parametrize(
    "config",
    [SMALL, helpers.both_kernels(PREFETCHING, max_concurrent_steps=3)],
    ids=["per_tile", "prefetching"],
)
def test_an_odd_number_of_column_tiles_is_stored_once(config):
    # 192 columns of 64 in both kernels: three column tiles, which the CTAs walk alone, each
    # loading its own row tiles (grouped_gemm_mosaic.pairs_columns); a tile missed would
    # leave poisoned rows. Prefetching, three contraction steps in three stages: each CTA's
    # visits one pipeline.
    (w_gate_up, gate_up_64), (w_down, down_64) = helpers.fp8_expert_weights(
        5, (E, 192, 192), SMALL_BLOCK
    )
    counts = np.array([7, C, 0], np.int32)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((E, C, 192)) * 3, DTYPE)
    x = jnp.where(jnp.arange(C)[None, :, None] < counts[:, None, None], x, jnp.nan)
    out = kernels.grouped_ffn(
        x, jnp.asarray(counts), w_gate_up, w_down, impl="mosaic", config=config
    )
    live = np.arange(C)[None, :] < counts[:, None]
    want = helpers.numpy_fp8_activations_ffn(
        np.where(live[..., None], np.asarray(x, np.float64), 0.0), counts, gate_up_64, down_64, 64
    )
    _within(out, want, DTYPE)
    assert not np.asarray(out, np.float64)[~live].any()


@pytest.mark.parametrize("slot_source", ["buffer", "token_rows"])
def test_the_tiles_rows_are_quantized_from_either_source(slot_source):
    # gathered_fp8_rows against quantize_blocks_reference of the row each tile row holds: a
    # slot buffer has more rows than the tiles (gathered, then quantized), a SlotRows source
    # of 7 token rows fewer (quantized, then gathered); the two must give the same bits.
    counts = jnp.array([5, 0, 3], jnp.int32)
    block_m, capacity, hidden = 4, 6, 128
    rng = np.random.default_rng(6)
    token_rows = rng.standard_normal((7, hidden)) * rng.uniform(0.01, 100, (7, 1))
    slot_row = np.full((E, capacity), -1, np.int32)
    slot_row[0, :5], slot_row[2, :3] = [3, 0, 6, 1, 4], [5, 2, 3]
    rows = slot_rows.SlotRows(jnp.asarray(token_rows, DTYPE), jnp.asarray(slot_row))
    x = rows.materialize() if slot_source == "buffer" else rows
    num_tiles = 4  # two of expert 0, one of expert 2, one dead
    tile_expert, slot_of_row, _ = grouped_gemm_mosaic.tile_rows(
        counts, capacity, block_m, num_tiles
    )
    values, scales = grouped_gemm_mosaic_fp8.gathered_fp8_rows(
        x, slot_of_row, tile_expert, block_m, 64
    )
    assert values.dtype == fp8_blocks.FP8_DTYPE and scales.shape == (2, num_tiles * block_m)
    want_values, want_scales = fp8_blocks.quantize_blocks_reference(
        np.asarray(rows.rows, np.float64), (1, 64)
    )
    live = np.asarray(tile_expert)[np.arange(num_tiles * block_m) // block_m] >= 0
    for row, slot in enumerate(np.asarray(slot_of_row)):
        if not live[row]:
            continue  # a dead tile's rows are never read
        if slot < 0:  # padding inside a live tile: zero bytes, zero scales
            assert not np.asarray(values[row], np.float32).any() and not scales[:, row].any()
            continue
        token = slot_row.reshape(-1)[slot]
        np.testing.assert_array_equal(np.asarray(values[row]), want_values[token])
        np.testing.assert_array_equal(np.asarray(scales[:, row]), want_scales[token])


def test_the_default_at_few_rows_an_expert_splits_the_columns(monkeypatch):
    # max_rows over the experts at most MOSAIC_FP8_SPLIT_MAX_ROWS_PER_EXPERT, both widths in
    # 256-column tiles: the default launch shapes split the columns (64-row tiles), and the
    # layer still matches the scheme's reference.
    hidden, ffn, block = 256, 256, (128, 128)
    (w_gate_up, gate_up_64), (w_down, down_64) = helpers.fp8_expert_weights(
        9, (E, hidden, ffn), block
    )
    counts = np.array([7, 0, 20], np.int32)
    x = jnp.asarray(np.random.default_rng(10).standard_normal((E, 32, hidden)) * 3, DTYPE)
    configs = []
    kernel = grouped_gemm_mosaic_fp8.grouped_ffn_mosaic_fp8

    def recording(*args, cfg, **kwargs):
        configs.append(cfg)
        return kernel(*args, cfg=cfg, **kwargs)

    monkeypatch.setattr(grouped_gemm_mosaic_fp8, "grouped_ffn_mosaic_fp8", recording)
    got = grouped_gemm.grouped_ffn_rows(
        x, jnp.asarray(counts), w_gate_up, w_down, impl="mosaic", max_rows=27
    )
    assert [cfg.gate_up.split_columns and cfg.down.split_columns for cfg in configs] == [True]
    want = helpers.numpy_fp8_activations_ffn(x, counts, gate_up_64, down_64, block[0])
    _within(got.materialize(), want, DTYPE)


@pytest.mark.parametrize("ffn", [768, 1408])
def test_fp8_kernels_compile_for_an_h200_on_the_cpu(monkeypatch, ffn):
    # The Mosaic GPU lowering of both FP8 kernels (FP8 wgmma, the scale loads, the hidden
    # rows' quantization) compiled by XLA for a described H200 (jtbo.aot) at Qwen3-30B-A3B's
    # expert shape, and at DeepSeek-V2-Lite's F (11 column tiles: the last pair has one),
    # with the default launch shapes of each (prefetching across tiles: 16 gate / up steps in
    # 4 stages; 6 down steps in 3, 11 waited).
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    monkeypatch.setattr(grouped_gemm_mosaic, "num_clusters", lambda interpret: 66)
    shapes = [((8, 512, 2048), jnp.bfloat16), ((8,), jnp.int32)]
    shapes += helpers.fp8_expert_shapes(8, 2048, ffn)

    default = gemm_config.mosaic_ffn_fp8(2048, ffn)

    def layer(x, counts, *fp8_arrays, cfg=default):
        return grouped_gemm_mosaic_fp8.grouped_ffn_mosaic_fp8(
            x, counts, *helpers.fp8_experts_of(*fp8_arrays), max_rows=2048, cfg=cfg,
            interpret=False,
        ).rows  # fmt: skip

    hlo = helpers.compiled_for_h200(layer, shapes)
    assert hlo.count('custom_call_target="mosaic_gpu_v2"') == 2
    if ffn == 768:
        # The memory warpgroup keeping 104 registers (the compute warpgroups 200).
        registers = helpers.both_kernels(gemm_config.MOSAIC_FFN_FP8, memory_registers=104)
        # The warpgroups splitting 256-column tiles, prefetching: gate / up in 2 stages (72 KB
        # each), down in 3 (40 KB each), within the shared memory.
        split = gemm_config.MosaicFfnConfig(
            gate_up=dataclasses.replace(
                default.gate_up, split_columns=True, max_concurrent_steps=2
            ),
            down=dataclasses.replace(default.down, split_columns=True, max_concurrent_steps=3),
        )
        # The waited pipelines (MOSAIC_FFN_FP8), each tile filling its own.
        for cfg in (gemm_config.MOSAIC_FFN_FP8, registers, split):
            hlo = helpers.compiled_for_h200(functools.partial(layer, cfg=cfg), shapes)
            assert hlo.count('custom_call_target="mosaic_gpu_v2"') == 2


def test_the_layer_matches_the_pallas_fp8_layer():
    # The routed experts' layer (experts_capacity: routing into capacity slots, the Mosaic
    # result read back from its tile-major rows) against the same layer on the Pallas FP8
    # kernels: one scheme, so the same tokens up to the hidden rows' rounding boundaries.
    hidden, ffn, block, config = CASES["64-blocks"]
    weights = [w for w, _ in helpers.fp8_expert_weights(7, (E, hidden, ffn), block)]
    rng = np.random.default_rng(8)
    tokens = jnp.asarray(rng.standard_normal((64, hidden)), DTYPE)
    first = rng.integers(0, E, 64)
    ids = jnp.asarray(np.stack([first, (first + 1) % E], axis=1).astype(np.int32))
    routing = jnp.asarray(rng.uniform(size=(64, 2)), jnp.float32)
    got = experts.experts_capacity(tokens, ids, routing, weights, 50, impl="mosaic", config=config)
    want = experts.experts_capacity(tokens, ids, routing, weights, 50, impl="pallas")
    _within(got, np.asarray(want, np.float64), DTYPE)
