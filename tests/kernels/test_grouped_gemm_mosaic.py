"""grouped_ffn(impl="mosaic"): the Mosaic GPU kernels (Mosaic GPU's interpreter on the CPU)
against the float32 exact-count reference, and their tile-major layout against numpy.

The interpreter runs a kernel in seconds, so the kernel cases are few and each covers several
edge cases at once: an empty expert, a full one (count == capacity), partial last tiles, a
capacity that is not a multiple of the row tile, and slot rows loaded through an index.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import aot, kernels
from jtbo.kernels import gemm_config, grouped_gemm, grouped_gemm_mosaic, impls, slot_rows
from jtbo.models import experts
from tests.kernels import helpers

E, C, H, F = 3, 200, 128, 128
# The smallest launch shapes: 128-row tiles, 64 columns per CTA (a cluster covers 128).
SMALL = gemm_config.MosaicFfnConfig(
    gate_up=gemm_config.MosaicGemmConfig(tile_n=64, max_concurrent_steps=2),
    down=gemm_config.MosaicGemmConfig(tile_n=64, max_concurrent_steps=2, grid_tile_width=2),
)
# The interpreter computes in float32; the GPU kernels take 16-bit floats only, held to the
# float32 reference at 3e-2 of the output's scale (the hidden activation is rounded too).
ON_CPU = jax.default_backend() == "cpu"
DTYPE = jnp.float32 if ON_CPU else jnp.bfloat16


def _close(got, want):
    scale = float(jnp.abs(want).max())
    tol = dict(atol=1e-4 * scale, rtol=1e-4) if ON_CPU else dict(atol=3e-2 * scale, rtol=0)
    chex.assert_trees_all_close(
        jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32), **tol
    )


def _weights(seed: int, dtype=DTYPE):
    k_gu, k_d = jax.random.split(jax.random.key(seed))
    w_gate_up = jax.random.normal(k_gu, (E, H, 2, F), jnp.float32) / np.sqrt(H)
    w_down = jax.random.normal(k_d, (E, F, H), jnp.float32) / np.sqrt(F)
    return w_gate_up.astype(dtype), w_down.astype(dtype)


# The same shapes with each step's wgmma left in flight while the next one's is issued.
IN_FLIGHT = helpers.both_kernels(SMALL, wgmma_in_flight=1)


# And with one pipeline over each CTA's tiles: the gate / up kernel with a step in flight (its
# compute warpgroups release the stage buffers), the down kernel waiting for each step.
PREFETCHING = gemm_config.MosaicFfnConfig(
    gate_up=dataclasses.replace(IN_FLIGHT.gate_up, prefetch_across_tiles=True),
    down=dataclasses.replace(SMALL.down, prefetch_across_tiles=True),
)


@pytest.mark.parametrize("config", [SMALL, IN_FLIGHT], ids=["waited", "in_flight"])
def test_slot_buffer_matches_the_reference_and_zeros_the_padding(config):
    # A partial second tile whose second warpgroup holds only padding (130 = 128 + 2), an
    # empty expert, a full one whose second tile's second warpgroup holds 8 rows (200).
    counts = jnp.array([130, 0, C], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (E, C, H), DTYPE)
    out = kernels.grouped_ffn(x, counts, *_weights(1), impl="mosaic", config=config)
    _close(out, grouped_gemm.grouped_ffn_reference(x, counts, *_weights(1)))
    assert not np.asarray(out)[0, 130:].any() and not np.asarray(out)[1].any()


@pytest.mark.parametrize(
    "counts, config",
    [
        ([200, 130, 200], PREFETCHING),
        ([5, 0, 0], PREFETCHING),
        ([60, 130, 200], PREFETCHING),
    ],
    ids=["three_tiles_a_cluster", "one_tile", "five_tiles"],
)
def test_prefetching_across_tiles_matches_the_reference(counts, config):
    # Six live tiles over the interpreter's two clusters: each runs a pipeline of three
    # (start, steady, stop); one live tile: one cluster runs a whole pipeline, one none; five
    # tiles: pipelines of three and two.
    counts = jnp.array(counts, jnp.int32)
    x = jax.random.normal(jax.random.key(2), (E, C, H), DTYPE)
    out = kernels.grouped_ffn(x, counts, *_weights(3), impl="mosaic", config=config)
    _close(out, grouped_gemm.grouped_ffn_reference(x, counts, *_weights(3)))
    assert not np.asarray(out)[np.arange(C)[None, :] >= np.asarray(counts)[:, None]].any()


def test_slot_rows_load_through_the_index_bf16():
    rows = jax.random.normal(jax.random.key(2), (50, H), jnp.bfloat16)
    slot_row = np.full((E, C), -1, np.int32)
    slot_row[0, :7] = np.arange(7)
    slot_row[2, :140] = np.random.default_rng(3).integers(0, 50, 140)
    slots = slot_rows.SlotRows(rows, jnp.asarray(slot_row))
    counts = jnp.array([7, 0, 140], jnp.int32)
    weights = _weights(4, jnp.bfloat16)
    got = grouped_gemm.grouped_ffn_rows(slots, counts, *weights, impl="mosaic", config=SMALL)
    assert isinstance(got, slot_rows.SlotRows)
    want = grouped_gemm.grouped_ffn_reference(slots, counts, *weights)
    scale = float(jnp.abs(want).max())  # bfloat16 on every backend: 3e-2 of the scale
    chex.assert_trees_all_close(
        got.materialize().astype(jnp.float32), want, atol=3e-2 * scale, rtol=0
    )


def test_the_layer_matches_the_xla_layer():
    tokens = jax.random.normal(jax.random.key(5), (64, H), DTYPE)
    first = np.random.default_rng(6).integers(0, E, 64)
    ids = jnp.asarray(np.stack([first, (first + 1) % E], axis=1).astype(np.int32))
    routing = jax.random.uniform(jax.random.key(7), (64, 2), jnp.float32)
    weights = _weights(8)
    got = experts.experts_capacity(tokens, ids, routing, weights, 50, impl="mosaic", config=SMALL)
    want = experts.experts_capacity(tokens, ids, routing, weights, 50, impl="xla")
    _close(got, want)


@settings(max_examples=8, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    block_m=st.sampled_from([2, 4]),
    bounded=st.booleans(),
)
def test_tile_rows_places_each_slot_once_in_its_experts_tiles(counts, block_m, bounded):
    capacity = 9
    num_tiles = sum(-(-c // block_m) for c in counts) + (0 if bounded else 2)
    tile_expert, slot_of_row, row_of_slot = map(
        np.asarray,
        grouped_gemm_mosaic.tile_rows(jnp.asarray(counts, jnp.int32), capacity, block_m, num_tiles),
    )
    for e, count in enumerate(counts):
        for j in range(capacity):
            row = row_of_slot[e, j]
            if j >= count:
                assert row == -1
                continue
            assert slot_of_row[row] == e * capacity + j
            assert tile_expert[row // block_m] == e
    filled = slot_of_row[slot_of_row >= 0]
    assert len(filled) == len(set(filled.tolist())) == sum(counts)
    assert (tile_expert[: sum(-(-c // block_m) for c in counts)] >= 0).all()
    assert (tile_expert[sum(-(-c // block_m) for c in counts) :] == -1).all()


# Three stages, which the contraction's three steps (192 / 64) fill, prefetching across tiles.
PREFETCHING_3 = helpers.both_kernels(PREFETCHING, max_concurrent_steps=3)


@pytest.mark.parametrize("config", [SMALL, PREFETCHING_3], ids=["per_tile", "prefetching"])
def test_an_odd_number_of_column_tiles_is_stored_once(config):
    # 192 columns of 64 in both kernels (DeepSeek-V2-Lite's F = 1408 is 11 tiles of 128):
    # three column tiles, which each CTA walks alone, loading its own row tiles
    # (grouped_gemm_mosaic.pairs_columns). Padding slots hold NaN: a kernel that read them
    # would spread it. Prefetching, each CTA walks its (tile, column) positions as one
    # pipeline.
    k_gu, k_d, k_x = jax.random.split(jax.random.key(7), 3)
    w_gate_up = (jax.random.normal(k_gu, (E, 192, 2, 192), jnp.float32) / np.sqrt(192)).astype(
        DTYPE
    )
    w_down = (jax.random.normal(k_d, (E, 192, 192), jnp.float32) / np.sqrt(192)).astype(DTYPE)
    counts = jnp.array([C, 0, 9], jnp.int32)
    live = jnp.arange(C)[None, :, None] < counts[:, None, None]
    x = jnp.where(live, jax.random.normal(k_x, (E, C, 192), DTYPE), jnp.nan)
    out = kernels.grouped_ffn(x, counts, w_gate_up, w_down, impl="mosaic", config=config)
    want = grouped_gemm.grouped_ffn_reference(jnp.where(live, x, 0), counts, w_gate_up, w_down)
    _close(out, want)
    assert not np.asarray(out)[~np.asarray(live[..., 0])].any()


def test_kernels_compile_for_an_h200_on_the_cpu_at_deepseek_v2_lite_width(monkeypatch, capfd):
    # Both kernels' Mosaic GPU lowering compiled by XLA for a described H200 (jtbo.aot) at
    # DeepSeek-V2-Lite's expert width F = 1408: 11 gate / up column tiles of 128.
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    monkeypatch.setattr(grouped_gemm_mosaic, "num_clusters", lambda interpret: 66)
    shapes = [((8, 512, 2048), jnp.bfloat16), ((8,), jnp.int32)]
    shapes += [((8, 2048, 2, 1408), jnp.bfloat16), ((8, 1408, 2048), jnp.bfloat16)]

    waited = helpers.both_kernels(gemm_config.MOSAIC_FFN, wgmma_in_flight=0)
    assert gemm_config.MOSAIC_FFN.gate_up.wgmma_in_flight == 1  # the default leaves one
    # The gate / up kernel's 32 contraction steps prefetch across tiles in stages of 4.
    prefetching = helpers.both_kernels(gemm_config.MOSAIC_FFN, prefetch_across_tiles=True)
    gate_up_prefetching = dataclasses.replace(prefetching, down=gemm_config.MOSAIC_FFN.down)

    def layer(x, counts, w_gate_up, w_down, cfg):
        return grouped_gemm_mosaic.grouped_ffn_mosaic(
            x, counts, w_gate_up, w_down, max_rows=2048, cfg=cfg, interpret=False
        ).rows

    # The default's PTX (Mosaic GPU prints it): the gate / up epilogue's exp and rsqrt run on
    # the special-function unit (ex2, rsqrt), and no correctly rounded division is left
    # (swiglu has none; approx_math makes any other one div.full).
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
    capfd.readouterr()
    hlo = helpers.compiled_for_h200(functools.partial(layer, cfg=gemm_config.MOSAIC_FFN), shapes)
    ptx = capfd.readouterr().out
    monkeypatch.delenv("MOSAIC_GPU_DUMP_PTX")
    assert hlo.count('custom_call_target="mosaic_gpu_v2"') == 2
    assert "ex2.approx" in ptx and "rsqrt.approx" in ptx and "div.rn.f32" not in ptx
    for cfg in (waited, gate_up_prefetching):
        hlo = helpers.compiled_for_h200(functools.partial(layer, cfg=cfg), shapes)
        assert hlo.count('custom_call_target="mosaic_gpu_v2"') == 2
    # The down kernel's 22 (1408 / 64) do not fill stages of 4.
    with pytest.raises(kernels.KernelUnavailableError, match=r"contraction steps \(22\)"):
        helpers.compiled_for_h200(functools.partial(layer, cfg=prefetching), shapes)


def test_swiglu_matches_float64_silu_times_up_past_exps_overflow():
    # The epilogues' sigmoid as rsqrt(1 + exp(-gate)) ** 2, here with the CPU's exact exp and
    # rsqrt: float32's precision (a few ulps, more where the sigmoid is tiny), and 0 where
    # exp(-gate) overflows to infinity (gate < -88).
    rng = np.random.default_rng(11)
    gate = np.concatenate([rng.standard_normal(4000) * 8, [-1e3, -100.0, -89.0, 0.0, 89.0, 1e3]])
    up = rng.standard_normal(gate.shape)
    got = grouped_gemm_mosaic.swiglu(jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32))
    gate64 = gate.astype(np.float32).astype(np.float64)
    want = gate64 * (0.5 + 0.5 * np.tanh(gate64 / 2)) * up.astype(np.float32)  # the sigmoid
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-30)


def test_shapes_the_kernels_cannot_tile_are_refused():
    x = jnp.ones((E, C, H), DTYPE)
    w_gate_up, w_down = jnp.ones((E, H, 2, 32), DTYPE), jnp.ones((E, 32, H), DTYPE)
    with pytest.raises(kernels.KernelUnavailableError, match="impl='mosaic' tiles 32 columns"):
        kernels.grouped_ffn(x, jnp.ones((E,), jnp.int32), w_gate_up, w_down, impl="mosaic")


def test_a_launch_shape_of_the_other_impl_is_refused():
    x = jnp.ones((E, C, H), DTYPE)
    with pytest.raises(ValueError, match="impl='mosaic' takes a MosaicFfnConfig"):
        kernels.grouped_ffn(
            x, jnp.ones((E,), jnp.int32), *_weights(0), impl="mosaic",
            config=gemm_config.GroupedFfnConfig(),
        )  # fmt: skip


def test_split_columns_is_refused_for_float_weights():
    x = jnp.ones((E, C, H), DTYPE)
    split = helpers.both_kernels(SMALL, split_columns=True)
    with pytest.raises(kernels.KernelUnavailableError, match="split_columns.*FP8 Mosaic"):
        kernels.grouped_ffn(
            x, jnp.ones((E,), jnp.int32), *_weights(0), impl="mosaic", config=split
        )  # fmt: skip


def test_launch_shapes_are_checked():
    with pytest.raises(ValueError, match="tile_m must be >= 64"):
        gemm_config.MosaicGemmConfig(tile_m=32)
    with pytest.raises(ValueError, match="both kernels tile the same rows"):
        gemm_config.MosaicFfnConfig(down=gemm_config.MosaicGemmConfig(tile_m=128))
    with pytest.raises(ValueError, match="wgmma_in_flight must be 0 or 1, got 2"):
        gemm_config.MosaicGemmConfig(wgmma_in_flight=2)
    with pytest.raises(ValueError, match=r"max_concurrent_steps \(1\) must exceed"):
        gemm_config.MosaicGemmConfig(max_concurrent_steps=1, wgmma_in_flight=1)
    assert gemm_config.MosaicGemmConfig(wgmma_in_flight=1).describe().endswith(" f1")
    prefetching = gemm_config.MosaicGemmConfig(wgmma_in_flight=1, prefetch_across_tiles=True)
    assert gemm_config.MosaicGemmConfig(memory_registers=72).describe() == "128x256x64 s4 t4 r72"
    for registers in (20, 60, 264):
        with pytest.raises(ValueError, match=f"multiple of 8 in \\[24, 256\\].*got {registers}"):
            gemm_config.MosaicGemmConfig(memory_registers=registers)
    assert prefetching.describe().endswith(" f1 p")


def test_auto_takes_mosaic_from_its_rows_on_hopper_and_pallas_below(monkeypatch):
    monkeypatch.setattr(impls, "backend", lambda: "cpu")
    assert grouped_gemm.auto_impl(1 << 20, 7168, 2048) == "xla"  # the CPU: the reference
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    monkeypatch.setattr(impls, "unavailable_reason", lambda impl, platform: None)
    assert grouped_gemm.auto_impl(grouped_gemm.MOSAIC_MIN_ROWS, 7168, 2048) == "mosaic"
    assert grouped_gemm.auto_impl(grouped_gemm.MOSAIC_MIN_ROWS - 1, 7168, 2048) == "pallas"
    assert grouped_gemm.auto_impl(1 << 20, 7168, 96) == "pallas"  # mosaic cannot tile 96
    # DeepSeek-V2-Lite's F: Mosaic tiles it with an odd number of column tiles (each CTA
    # walking alone), float and FP8 weights alike.
    assert grouped_gemm.auto_impl(1 << 20, 2048, 1408) == "mosaic"
    fp8 = dict(quant_block=(128, 128), num_experts=64)
    assert grouped_gemm.auto_impl(1 << 20, 2048, 1408, **fp8) == "mosaic"
    assert grouped_gemm.auto_impl(1 << 20, 7168, 40) == "xla"  # nor can pallas tile 40
    assert grouped_gemm.auto_impl(1 << 20, 7168, 2048, jnp.float32) == "pallas"  # 16-bit only


@pytest.mark.skipif(ON_CPU, reason="the interpreter takes float32")
def test_float32_is_refused_on_gpus():
    x = jnp.ones((E, C, H), jnp.float32)
    with pytest.raises(kernels.KernelUnavailableError, match="16-bit floats on GPUs"):
        kernels.grouped_ffn(
            x, jnp.ones((E,), jnp.int32), *_weights(0, jnp.float32), impl="mosaic", config=SMALL
        )


def test_auto_with_launch_shapes_is_refused():
    x = jnp.ones((E, C, H), DTYPE)
    with pytest.raises(ValueError, match="name the impl"):
        kernels.grouped_ffn(x, jnp.ones((E,), jnp.int32), *_weights(0), config=SMALL)
