"""grouped_ffn (xla and pallas; the Pallas interpreter on the CPU) vs a float64 numpy loop.

Tolerances: float32 inputs agree with float64 to 1e-4 (different summation orders over
H = 64); bfloat16 inputs round the hidden activation to bfloat16 in both impls and
accumulate in float32, so they are held to 3e-2 of the output's scale against float64.
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
from jax.experimental import pallas as pl

from jtbo import aot, kernels
from jtbo.kernels import (
    fp8_blocks,
    gemm_config,
    grouped_gemm,
    grouped_gemm_mosaic,
    impls,
    tile_table,
)
from tests.kernels import helpers

E, H, F = 4, 64, 32
# 16-row tiles so the 21 capacity slots span two tiles, the second one partial.
SMALL = gemm_config.GroupedFfnConfig(
    gate_up=gemm_config.GemmConfig(block_m=16, block_n=16, block_k=32, group_m=2),
    down=gemm_config.GemmConfig(block_m=32, block_n=32, block_k=16, group_m=3),
)


# float32 matmuls run in TF32 on NVIDIA GPUs (XLA's default precision, Triton's tl.dot): about
# 1e-3 relative there, against float32 rounding in the CPU interpreter.
F32_TOL = (
    dict(atol=1e-4, rtol=1e-4) if jax.default_backend() == "cpu" else dict(atol=3e-3, rtol=3e-3)
)


def _impls():
    return ("xla", "pallas")


_numpy_ffn = helpers.numpy_ffn


def _inputs(seed, capacity, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((E, capacity, H))
    w_gate_up = rng.standard_normal((E, H, 2, F)) / np.sqrt(H)
    w_down = rng.standard_normal((E, F, H)) / np.sqrt(F)
    return [jnp.asarray(a, dtype) for a in (x, w_gate_up, w_down)]


@pytest.mark.parametrize("impl", _impls())
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), counts=st.lists(st.integers(-2, 23), min_size=E, max_size=E))
def test_matches_numpy_float32(impl, seed, counts):
    x, w_gate_up, w_down = _inputs(seed, 21)
    counts = np.asarray(counts, np.int32)
    out = kernels.grouped_ffn(x, jnp.asarray(counts), w_gate_up, w_down, impl=impl, config=SMALL)
    chex.assert_trees_all_close(out, _numpy_ffn(x, counts, w_gate_up, w_down), **F32_TOL)


@pytest.mark.parametrize("impl", _impls())
def test_counts_zero_full_and_partial_tiles_bf16(impl):
    # 0, all 21 slots (a full and a partial tile), a tile and one row, and 5 rows.
    counts = np.array([0, 21, 17, 5], np.int32)
    x, w_gate_up, w_down = _inputs(7, 21, jnp.bfloat16)
    out = kernels.grouped_ffn(x, jnp.asarray(counts), w_gate_up, w_down, impl=impl, config=SMALL)
    assert out.dtype == jnp.bfloat16
    want = _numpy_ffn(x.astype(jnp.float32), counts, w_gate_up.astype(jnp.float32), w_down)
    got = np.asarray(out, np.float64)
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
    for e, count in enumerate(counts):
        assert not got[e, count:].any()  # past the count: exactly zero
        assert (np.abs(got[e, :count]).max(axis=-1) > 0).all()  # live rows were computed


def test_reference_matches_numpy():
    counts = np.array([3, 0, 21, 9], np.int32)
    x, w_gate_up, w_down = _inputs(3, 21)
    ref = grouped_gemm.grouped_ffn_reference(x, jnp.asarray(counts), w_gate_up, w_down)
    chex.assert_trees_all_close(ref, _numpy_ffn(x, counts, w_gate_up, w_down), **F32_TOL)


@pytest.mark.parametrize("impl", _impls())
def test_padding_slots_do_not_leak(impl):
    # NaN in every slot past the counts: reading them into a live row would leak NaN.
    counts = np.array([2, 21, 0, 16], np.int32)
    x, w_gate_up, w_down = _inputs(5, 21)
    live = np.arange(21)[None, :, None] < counts[:, None, None]
    poisoned = jnp.where(live, x, jnp.nan)
    out = kernels.grouped_ffn(
        poisoned, jnp.asarray(counts), w_gate_up, w_down, impl=impl, config=SMALL
    )
    chex.assert_trees_all_close(out, _numpy_ffn(x, counts, w_gate_up, w_down), **F32_TOL)


def test_max_rows_bounds_the_grid_without_changing_results():
    counts = np.array([5, 0, 21, 3], np.int32)  # 29 rows
    x, w_gate_up, w_down = _inputs(11, 21)
    out = kernels.grouped_ffn(
        x, jnp.asarray(counts), w_gate_up, w_down, impl="pallas", config=SMALL, max_rows=29
    )
    chex.assert_trees_all_close(out, _numpy_ffn(x, counts, w_gate_up, w_down), **F32_TOL)


def _kernel_tile_table(counts, block_m: int, capacity: int, num_tiles: int) -> np.ndarray:
    """``[3, num_tiles]`` (expert, first row, end row) as each program of the kernels finds
    its tile (``grouped_gemm._tile_rows``, the Pallas interpreter), the end row read back
    from its row mask; dead tiles as ``row_tiles`` lists them (-1, 0, 0)."""

    def kernel(counts_ref, out_ref):
        tile = pl.program_id(0)
        expert, start, live = grouped_gemm._tile_rows(counts_ref, tile, block_m, capacity)
        end = start + jnp.sum(live.astype(jnp.int32))
        is_live = expert >= 0
        out_ref[:, tile] = jnp.stack([expert, jnp.where(is_live, start, 0),
                                      jnp.where(is_live, end, 0)])  # fmt: skip

    padded = grouped_gemm._padded_counts(jnp.asarray(counts, jnp.int32))
    table = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((3, num_tiles), jnp.int32),
        grid=(num_tiles,),
        interpret=True,
    )(padded)
    return np.asarray(table)


@settings(max_examples=8, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=9),
    block_m=st.sampled_from([4, 16]),
    spare=st.integers(0, 3),
)
def test_each_program_finds_the_tile_the_table_lists(counts, block_m, spare):
    # An expert count that is not a power of two (padded with empty experts), empty experts
    # between live ones, tiles that end inside an expert's rows, and dead tiles past the live
    # ones. An expert's end row is its count, not its capacity, so a row mask past it shows.
    # tile_table.row_tiles is the XLA table (checked against numpy in its own tests).
    capacity = 41
    num_tiles = max(1, sum(-(-c // block_m) for c in counts) + spare)
    group_start = jnp.arange(len(counts), dtype=jnp.int32) * capacity
    want = tile_table.row_tiles(group_start, jnp.asarray(counts, jnp.int32), block_m, num_tiles)
    got = _kernel_tile_table(counts, block_m, capacity, num_tiles)
    # An end row counts the rows of the tile before the end, at most block_m of them.
    want = np.array(want)
    want[2] = np.minimum(want[2], want[1] + block_m) * (want[0] >= 0)
    np.testing.assert_array_equal(got, want)


def test_tile_rows_follow_the_balanced_load_under_max_rows():
    # 64 tokens x top-8 over 128 experts, capacity factor 4: 16-slot capacity, 4 rows each.
    assert grouped_gemm.tile_row_count(16, 512, 128, True) == 4
    assert grouped_gemm.tile_row_count(64, 2048, 128, True) == 16  # 256 tokens
    assert grouped_gemm.tile_row_count(64, 2048, 128, False) == 64  # capacity-sized tiles
    assert grouped_gemm.tile_row_count(64, None, 128, True) == 64  # no bound: the capacity
    assert grouped_gemm.tile_row_count(4, 2048, 128, True) == 4  # never past the capacity
    assert grouped_gemm.tile_row_count(8, 1, 128, True) == 1
    assert gemm_config.GROUPED_FFN_FP8.balanced_row_tiles
    assert not gemm_config.GROUPED_FFN.balanced_row_tiles


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), hot=st.integers(0, E - 1), cold=st.integers(0, 3))
def test_an_expert_past_the_balanced_tile_takes_more_tiles(seed, hot, cold):
    # max_rows sizes the tiles for the balanced load (16 or 32 rows here, from a bound of
    # 64-73 rows over 4 experts): one hot expert holding all its 64 slots spans two to four
    # tiles, the others a few rows each.
    wide = gemm_config.GemmConfig(block_m=64, block_n=16, block_k=32, group_m=2)
    config = gemm_config.GroupedFfnConfig(gate_up=wide, down=wide, balanced_row_tiles=True)
    counts = np.full(E, cold, np.int32)
    counts[hot] = 64
    x, w_gate_up, w_down = _inputs(seed, 64)
    out = kernels.grouped_ffn(
        x, jnp.asarray(counts), w_gate_up, w_down, impl="pallas", config=config,
        max_rows=int(counts.sum()),
    )  # fmt: skip
    chex.assert_trees_all_close(out, _numpy_ffn(x, counts, w_gate_up, w_down), **F32_TOL)


def test_jit_traces_once_per_shape():
    x, w_gate_up, w_down = _inputs(1, 21)
    # The Pallas interpreter's first lowering in a process imports a module that adds a jax
    # config state to the tracing context, so the first program traced then retraces once:
    # lower one beforehand, so that this test counts the same traces run alone or after others.
    counts = jnp.zeros(E, jnp.int32)
    jax.jit(kernels.grouped_ffn, static_argnames=("impl", "config")).lower(
        x, counts, w_gate_up, w_down, impl="pallas", config=SMALL
    )
    fn = jax.jit(
        chex.assert_max_traces(
            lambda c: kernels.grouped_ffn(x, c, w_gate_up, w_down, impl="pallas", config=SMALL),
            n=1,
        )
    )
    for counts in ([1, 2, 3, 4], [21, 0, 0, 7]):
        fn(jnp.asarray(counts, jnp.int32))


def test_the_jitted_kernel_call_matches_numpy():
    # The nested jit that compiled kernels go through, run here on the Pallas interpreter: its
    # static launch shapes and options reach the kernels (zero padding, random counts).
    x, w_gate_up, w_down = _inputs(6, 21)
    counts = np.asarray([5, 21, 0, 17], np.int32)
    out = grouped_gemm._kernel_ffn_jit(
        x, jnp.asarray(counts), w_gate_up, w_down, impl="pallas", cfg=SMALL, max_rows=None,
        interpret=True, zero_padding=True, fp8_activations=True,
    )  # fmt: skip
    chex.assert_trees_all_close(out, _numpy_ffn(x, counts, w_gate_up, w_down), **F32_TOL)


@pytest.mark.parametrize("impl", ["pallas", impls.MOSAIC])
def test_a_program_of_many_layers_lowers_the_kernels_once_and_calls_them_per_layer(
    monkeypatch, impl
):
    # Three layers of compiled kernels with equal shapes, lowered for a described H200: one
    # lowering of the kernels (a private function of the module) called by each layer with
    # its own rows and weights. (The interpreters are called directly: no such function.)
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    monkeypatch.setattr(impls, "unavailable_reason", lambda impl, platform: None)
    monkeypatch.setattr(grouped_gemm_mosaic, "num_clusters", lambda interpret: 66)
    shapes = [((8, 64, 256), jnp.bfloat16), ((8,), jnp.int32)]
    shapes += [((8, 256, 2, 128), jnp.bfloat16), ((8, 128, 256), jnp.bfloat16)] * 3

    def layers(x, counts, *weights):
        for w_gate_up, w_down in zip(weights[::2], weights[1::2], strict=True):
            x = x + kernels.grouped_ffn(x, counts, w_gate_up, w_down, impl=impl, max_rows=256)
        return x

    text = helpers.lowered_for_h200(layers, shapes).as_text()
    assert text.count("func.func private @_kernel_ffn(") == 1, text.count("@_kernel_ffn")
    assert text.count("call @_kernel_ffn(") == 3


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("x_slots", lambda x, c, gu, d: (x[0], c, gu, d)),
        ("w_gate_up", lambda x, c, gu, d: (x, c, gu[:, :, :1], d)),
        ("w_down", lambda x, c, gu, d: (x, c, gu, d[:, :, :8])),
        ("counts", lambda x, c, gu, d: (x, c[:2], gu, d)),
        ("counts", lambda x, c, gu, d: (x, c.astype(jnp.float32), gu, d)),
        ("share a dtype", lambda x, c, gu, d: (x.astype(jnp.bfloat16), c, gu, d)),
    ],
)
def test_bad_inputs_raise(field, change):
    x, w_gate_up, w_down = _inputs(0, 8)
    args = change(x, jnp.ones((E,), jnp.int32), w_gate_up, w_down)
    with pytest.raises(ValueError, match=field):
        kernels.grouped_ffn(*args, impl="xla")


def test_bad_impl_and_max_rows_raise():
    x, w_gate_up, w_down = _inputs(0, 8)
    counts = jnp.ones((E,), jnp.int32)
    with pytest.raises(ValueError, match="impl"):
        kernels.grouped_ffn(x, counts, w_gate_up, w_down, impl="cuda")
    with pytest.raises(ValueError, match="max_rows"):
        kernels.grouped_ffn(x, counts, w_gate_up, w_down, impl="pallas", max_rows=-1)
    if jax.default_backend() == "cpu":
        with pytest.raises(kernels.KernelUnavailableError, match="triton"):
            kernels.grouped_ffn(x, counts, w_gate_up, w_down, impl="triton")


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_m", 48), ("block_n", 8), ("num_warps", 3), ("group_m", 0), ("num_stages", 0)],
)
def test_gemm_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        gemm_config.GemmConfig(**{field: value})


def test_gemm_config_fits_blocks():
    assert gemm_config.fit(128, 7168) == 128 and gemm_config.fit(128, 96) == 32
    cfg = gemm_config.GemmConfig(block_m=128)
    assert cfg.rows_block(5) == 16 and cfg.rows_block(40) == 64 and cfg.rows_block(999) == 128


@pytest.mark.parametrize("gathered", [False, True])
def test_kernels_compile_for_an_h200_on_the_cpu(gathered):
    # The Triton lowering and XLA's Triton compile of both kernels at DeepSeek-V3's expert
    # shapes (H 7168, F 2048, bf16, default config), for a described H200 (jtbo.aot): slot
    # rows, or source rows loaded through a row index per slot (SlotRows).
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    shapes = [((300, 7168), jnp.bfloat16), ((4, 96), jnp.int32)] if gathered else []
    shapes += [] if gathered else [((4, 96, 7168), jnp.bfloat16)]
    shapes += [((4,), jnp.int32)]
    shapes += [((4, 7168, 2, 2048), jnp.bfloat16), ((4, 2048, 7168), jnp.bfloat16)]
    kernel = functools.partial(
        grouped_gemm.grouped_ffn_pallas, max_rows=200, cfg=gemm_config.GROUPED_FFN, interpret=False
    )
    if gathered:
        kernel = functools.partial(
            lambda rows, slot_row, *rest, run: run(kernels.SlotRows(rows, slot_row), *rest),
            run=kernel,
        )
    hlo = helpers.compiled_for_h200(kernel, shapes)
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 2


def _slot_rows(seed, capacity, counts, dtype=np.float32):
    """Random source rows and a scattered row index per slot: live slots name distinct rows
    in shuffled order (one live slot empty, -1), slots past the counts hold stale indices."""
    rng = np.random.default_rng(seed)
    num_rows = E * capacity + 5
    rows = jnp.asarray(rng.standard_normal((num_rows, H)), dtype)
    slot_row = rng.permutation(num_rows)[: E * capacity].reshape(E, capacity).astype(np.int32)
    live = np.argwhere(np.arange(capacity)[None, :] < np.clip(counts, 0, capacity)[:, None])
    if len(live):
        slot_row[tuple(live[len(live) // 2])] = -1
    return kernels.SlotRows(rows=rows, slot_row=jnp.asarray(slot_row))


@pytest.mark.parametrize("impl", _impls())
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), counts=st.lists(st.integers(0, 21), min_size=E, max_size=E))
def test_slot_rows_match_their_materialized_slots(impl, seed, counts):
    counts = np.asarray(counts, np.int32)
    slots = _slot_rows(seed, 21, counts)
    _, w_gate_up, w_down = _inputs(seed, 21)
    out = kernels.grouped_ffn(
        slots, jnp.asarray(counts), w_gate_up, w_down, impl=impl, config=SMALL
    )
    want = _numpy_ffn(np.asarray(slots.materialize()), counts, w_gate_up, w_down)
    chex.assert_trees_all_close(out, want, **F32_TOL)


def test_slot_rows_reference_matches_numpy():
    counts = np.array([3, 0, 21, 9], np.int32)
    slots = _slot_rows(11, 21, counts)
    _, w_gate_up, w_down = _inputs(11, 21)
    got = grouped_gemm.grouped_ffn_reference(slots, jnp.asarray(counts), w_gate_up, w_down)
    want = _numpy_ffn(np.asarray(slots.materialize()), counts, w_gate_up, w_down)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_bad_slot_rows_raise():
    _, w_gate_up, w_down = _inputs(0, 21)
    counts = jnp.zeros((E,), jnp.int32)
    flat = kernels.SlotRows(rows=jnp.zeros((8, H)), slot_row=jnp.zeros((E * 21,), jnp.int32))
    with pytest.raises(ValueError, match="slot_row \\[E, C\\]"):
        kernels.grouped_ffn(flat, counts, w_gate_up, w_down, impl="xla")
    floats = kernels.SlotRows(rows=jnp.zeros((8, H)), slot_row=jnp.zeros((E, 21), jnp.float32))
    with pytest.raises(ValueError, match="integers"):
        kernels.grouped_ffn(floats, counts, w_gate_up, w_down, impl="xla")


@pytest.mark.parametrize("impl", _impls())
def test_without_zero_padding_the_live_rows_are_unchanged(impl):
    counts = np.array([0, 21, 17, 5], np.int32)
    slots = _slot_rows(5, 21, counts)
    _, w_gate_up, w_down = _inputs(5, 21)
    run = functools.partial(
        kernels.grouped_ffn, slots, jnp.asarray(counts), w_gate_up, w_down, impl=impl,
        config=SMALL,
    )  # fmt: skip
    zeroed, unzeroed = np.asarray(run()), np.asarray(run(zero_padding=False))
    live = np.arange(21)[None, :] < counts[:, None]
    np.testing.assert_array_equal(unzeroed[live], zeroed[live])
    assert not zeroed[~live].any()


# FP8 weights, stored contraction-last. F = 48 in column blocks of 32 leaves a 16-wide last
# block, so the up rows' blocks start mid-way through the stored [2F]; each block's magnitude
# is drawn over several orders, so a scale read from the wrong block shows.
FP8_F = 48
FP8_BLOCK = (16, 32)  # (contraction, output)


def _fp8_weights(seed):
    """``(w_gate_up, w_down)`` as ``BlockQuantized`` (stored contraction-last) and as their
    float64 dequantization."""
    return helpers.fp8_expert_weights(seed, (E, H, FP8_F), FP8_BLOCK)


def _numpy_fp8_activations_ffn(x, counts, w_gate_up, w_down):
    """``_numpy_ffn`` with the rows and the hidden rows through FP8 per FP8_BLOCK[0] columns."""
    return helpers.numpy_fp8_activations_ffn(x, counts, w_gate_up, w_down, FP8_BLOCK[0])


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_fp8_weights_match_their_dequantized_reference(impl, dtype):
    # Weight-only FP8. 0 rows, a full and a partial 16-row tile, a tile and one row, 5 rows.
    counts = np.array([0, 21, 17, 5], np.int32)
    (w_gate_up, gate_up_64), (w_down, down_64) = _fp8_weights(3)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((E, 21, H)), dtype)
    out = kernels.grouped_ffn(
        x, jnp.asarray(counts), w_gate_up, w_down, impl=impl, config=SMALL,
        fp8_activations=False,
    )  # fmt: skip
    assert out.dtype == dtype
    want = _numpy_ffn(np.asarray(x, np.float32), counts, gate_up_64, down_64)
    got = np.asarray(out, np.float64)
    if dtype == np.float32:  # the dequantized weights exactly, float32 rounding only
        np.testing.assert_allclose(got, want, **F32_TOL)
    else:  # bf16 rows and hidden activation (as the float weights' bf16 test)
        assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
    for e, count in enumerate(counts):
        assert not got[e, count:].any()
    ref = grouped_gemm.grouped_ffn_reference(
        x, jnp.asarray(counts), w_gate_up, w_down, fp8_activations=False
    )
    chex.assert_trees_all_close(
        ref, _numpy_ffn(np.asarray(x, np.float32), counts, gate_up_64, down_64), **F32_TOL
    )


# FP8 activations: the kernel quantizes the same rows as the numpy reference, bit for bit, but
# sums the hidden rows in another order; a hidden value on a rounding boundary may then land on
# the neighbouring e4m3 value (2**-3 of itself), a few of the 16 x 48 x 4 values at most.
FP8_ACTIVATIONS_TOL = 5e-3  # of the output's norm


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_fp8_activations_match_the_quantized_reference(impl, dtype):
    counts = np.array([21, 0, 5, 17], np.int32)
    (w_gate_up, gate_up_64), (w_down, down_64) = _fp8_weights(5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((E, 21, H)) * 3, dtype)
    out = kernels.grouped_ffn(x, jnp.asarray(counts), w_gate_up, w_down, impl=impl, config=SMALL)
    assert out.dtype == dtype
    want = _numpy_fp8_activations_ffn(x, counts, gate_up_64, down_64)
    got = np.asarray(out, np.float64)
    bf16_rounding = 0 if dtype == np.float32 else 2**-8  # the output's own dtype
    tol = FP8_ACTIVATIONS_TOL + bf16_rounding
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)
    for e, count in enumerate(counts):
        assert not got[e, count:].any()
        assert (np.abs(got[e, :count]).max(axis=-1) > 0).all()
    # The quantization shows: weight-only FP8 is a different function of the same weights.
    weight_only = _numpy_ffn(np.asarray(x, np.float32), counts, gate_up_64, down_64)
    assert np.linalg.norm(weight_only - want) > 3 * tol * np.linalg.norm(want)
    ref = grouped_gemm.grouped_ffn_reference(x, jnp.asarray(counts), w_gate_up, w_down)
    ref = np.asarray(ref, np.float64)
    assert np.linalg.norm(ref - want) <= FP8_ACTIVATIONS_TOL * np.linalg.norm(want)


def test_fp8_rows_quantized_before_or_inside_the_gate_up_kernel_agree():
    # 32-column quantization groups over a slot buffer: a contraction step of 16 holds half a
    # group, so the rows are quantized before the kernel; a step of 32 is one group, quantized
    # inside it (test_fp8_slot_rows_load_through_the_index: source rows, quantized before).
    counts = np.array([9, 21, 0, 14], np.int32)
    (w_gate_up, gate_up_64), (w_down, down_64) = helpers.fp8_expert_weights(
        11, (E, H, 64), (32, 32)
    )
    x = jnp.asarray(np.random.default_rng(12).standard_normal((E, 21, H)) * 3, jnp.float32)
    want = helpers.numpy_fp8_activations_ffn(x, counts, gate_up_64, down_64, 32)
    for block_k in (16, 32):
        gate_up = dataclasses.replace(SMALL.gate_up, block_n=32, block_k=block_k)
        cfg = dataclasses.replace(SMALL, gate_up=gate_up)
        out = kernels.grouped_ffn(
            x, jnp.asarray(counts), w_gate_up, w_down, impl="pallas", config=cfg
        )
        got = np.asarray(out, np.float64)
        assert np.linalg.norm(got - want) <= FP8_ACTIVATIONS_TOL * np.linalg.norm(want), block_k
        for e, count in enumerate(counts):
            assert not got[e, count:].any()


def test_fp8_slot_rows_load_through_the_index():
    counts = np.array([3, 0, 21, 9], np.int32)
    slots = _slot_rows(8, 21, counts)
    (w_gate_up, gate_up_64), (w_down, down_64) = _fp8_weights(8)
    for activations, numpy_ffn in ((False, _numpy_ffn), (True, _numpy_fp8_activations_ffn)):
        out = kernels.grouped_ffn(
            slots, jnp.asarray(counts), w_gate_up, w_down, impl="pallas", config=SMALL,
            max_rows=33, fp8_activations=activations,
        )  # fmt: skip
        want = numpy_ffn(np.asarray(slots.materialize()), counts, gate_up_64, down_64)
        if activations:
            got = np.asarray(out, np.float64)
            assert np.linalg.norm(got - want) <= FP8_ACTIVATIONS_TOL * np.linalg.norm(want)
        else:
            chex.assert_trees_all_close(out, want, **F32_TOL)


def test_fp8_tiles_stay_inside_one_block():
    # The default launch shapes (block_n 128 / 256) shrink to the blocks; a 16-row block
    # needs block_k 16.
    cfg = gemm_config.GemmConfig(block_m=64, block_n=256, block_k=64)
    assert grouped_gemm._launch(40, 7168, 2048, cfg, False, (128, 128)) == (64, 128, 64)
    assert grouped_gemm._launch(40, 64, 48, cfg, True, FP8_BLOCK) == (64, 16, 16)
    with pytest.raises(kernels.KernelUnavailableError, match="inside FP8 blocks"):
        grouped_gemm._launch(40, 64, 48, cfg, False, (8, 32))


def test_weight_only_fp8_is_refused_by_mosaic_and_auto_takes_mosaic_for_fp8_rows(monkeypatch):
    (w_gate_up, _), (w_down, _) = _fp8_weights(0)
    x, counts = jnp.ones((E, 8, H), jnp.bfloat16), jnp.ones((E,), jnp.int32)
    with pytest.raises(ValueError, match="impl='mosaic' multiplies FP8 weights by FP8 rows"):
        kernels.grouped_ffn(x, counts, w_gate_up, w_down, impl="mosaic", fp8_activations=False)
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    monkeypatch.setattr(impls, "unavailable_reason", lambda impl, platform: None)
    monkeypatch.setattr(grouped_gemm_mosaic, "tiles", lambda *args: True)
    rows = grouped_gemm.MOSAIC_MIN_ROWS
    assert grouped_gemm.auto_impl(rows, 7168, 2048) == "mosaic"
    # FP8: the threshold is per expert (few experts fill their tiles at fewer rows).
    per_expert, block = grouped_gemm.MOSAIC_FP8_MIN_ROWS_PER_EXPERT, (128, 128)
    for experts in (8, 128):  # Mixtral's and Qwen3-30B-A3B's expert counts, Qwen3's shape
        fp8 = dict(quant_block=block, num_experts=experts)
        assert grouped_gemm.auto_impl(per_expert * experts, 2048, 768, **fp8) == "mosaic"
        assert grouped_gemm.auto_impl(per_expert * experts - 1, 2048, 768, **fp8) == "pallas"
    fp8 = dict(quant_block=block, num_experts=8)
    weight_only = dict(fp8, fp8_activations=False)
    assert grouped_gemm.auto_impl(rows, 7168, 2048, **weight_only) == "pallas"
    assert grouped_gemm.auto_impl(rows, 7168, 1408, **fp8) == "mosaic"  # 11 tiles
    assert grouped_gemm.auto_impl(16, 7168, 2048, quant_block=(128, 8), num_experts=8) == "xla"
    with pytest.raises(ValueError, match="needs num_experts for FP8 weights"):
        grouped_gemm.auto_impl(rows, 7168, 2048, quant_block=block)


def test_fp8_bad_weights_raise():
    (w_gate_up, _), (w_down, down_64) = _fp8_weights(0)
    x, counts = jnp.ones((E, 8, H), jnp.float32), jnp.ones((E,), jnp.int32)
    dense_down = jnp.asarray(down_64, jnp.float32)
    with pytest.raises(ValueError, match="both be FP8"):
        kernels.grouped_ffn(x, counts, w_gate_up, dense_down, impl="xla")
    across = fp8_blocks.quantize_blocks(dense_down, (2, 16, 32))  # blocks span two experts
    with pytest.raises(ValueError, match="w_down blocks .* contraction and output axes"):
        kernels.grouped_ffn(x, counts, w_gate_up, across, impl="xla")
    with pytest.raises(ValueError, match="float16 or wider"):
        kernels.grouped_ffn(x.astype(jnp.float8_e4m3fn), counts, w_gate_up, w_down, impl="xla")


def test_fp8_kernels_compile_for_an_h200_on_the_cpu():
    # The Triton lowering of the FP8 loads, their widening and the scale loads, compiled by
    # XLA for a described H200 (jtbo.aot) at DeepSeek-V3's expert shapes and 128 x 128 blocks.
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    shapes = [((4, 96, 7168), jnp.bfloat16), ((4,), jnp.int32)]
    shapes += helpers.fp8_expert_shapes(4, 7168, 2048)

    def kernel(x, counts, *fp8_arrays):
        w_gate_up, w_down = helpers.fp8_experts_of(*fp8_arrays)
        return [
            grouped_gemm.grouped_ffn_pallas(
                x,
                counts,
                w_gate_up,
                w_down,
                max_rows=200,
                cfg=gemm_config.GROUPED_FFN_FP8,
                interpret=False,
                fp8_activations=activations,
            )  # fmt: skip
            for activations in (True, False)
        ]

    hlo = helpers.compiled_for_h200(kernel, shapes)
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 4


def test_triton_offsets_fit_only_where_32_bit_offsets_stay_below_2_31():
    assert grouped_gemm.triton_offsets_fit(2**31, 1)
    assert not grouped_gemm.triton_offsets_fit(2**31 + 1, 1)  # 32-bit offsets, wrapped
    assert not grouped_gemm.triton_offsets_fit(2**32, 1)
    assert grouped_gemm.triton_offsets_fit(2**32 + 1, 1)  # over 2**32 bytes: 64-bit offsets
    assert grouped_gemm.triton_offsets_fit(2**31 + 1, 2)  # bf16: 64-bit past 2**31 values


def _deepseek_v3_fp8_down(num_experts):
    """Shapes of DeepSeek-V3's FP8 ``w_down`` for ``num_experts`` experts (no values)."""
    hidden, ffn = 7168, 2048
    values = jax.ShapeDtypeStruct((num_experts, hidden, ffn), fp8_blocks.FP8_DTYPE)
    scales = jax.ShapeDtypeStruct((num_experts, hidden // 128, ffn // 128), jnp.float32)
    return fp8_blocks.BlockQuantized(values, scales, (1, 128, 128), fp8_blocks.expert_axes(3))


def test_pallas_refuses_fp8_weights_its_offsets_cannot_index():
    # DeepSeek-V3's w_down with all 256 experts on one device: 3.76e9 FP8 values, 3.5 GiB.
    def operands(num_experts):
        shape = (num_experts, 2048, 7168)
        return jax.eval_shape(
            lambda w: grouped_gemm._weight_operands(w, shape)[0], _deepseek_v3_fp8_down(num_experts)
        )

    with pytest.raises(kernels.KernelUnavailableError, match="cannot index a float8_e4m3fn"):
        operands(256)
    values, _ = operands(146)  # 2.14e9 values: under 2**31
    assert values.shape == (146, 7168, 2048)


def test_auto_takes_mosaic_where_pallas_cannot_index_the_weights(monkeypatch):
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    monkeypatch.setattr(impls, "unavailable_reason", lambda impl, platform: None)
    block = (128, 128)
    # Decode rows, DeepSeek-V3's experts: Pallas below the Mosaic threshold, unless the
    # experts' FP8 weights are past what its offsets index.
    assert grouped_gemm.auto_impl(512, 7168, 2048, quant_block=block, num_experts=32) == "pallas"
    assert grouped_gemm.auto_impl(512, 7168, 2048, quant_block=block, num_experts=256) == "mosaic"
    weight_only = dict(quant_block=block, fp8_activations=False, num_experts=256)
    assert grouped_gemm.auto_impl(512, 7168, 2048, **weight_only) == "xla"
    assert grouped_gemm.auto_impl(512, 7168, 2048, num_experts=256) == "pallas"  # bf16: 64-bit
