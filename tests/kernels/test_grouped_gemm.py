"""grouped_ffn (xla and pallas; the Pallas interpreter on the CPU) vs a float64 numpy loop.

Tolerances: float32 inputs agree with float64 to 1e-4 (different summation orders over
H = 64); bfloat16 inputs round the hidden activation to bfloat16 in both impls and
accumulate in float32, so they are held to 3e-2 of the output's scale against float64.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import aot, kernels
from jtbo.kernels import gemm_config, grouped_gemm

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


def _numpy_ffn(x, counts, w_gate_up, w_down):
    x, wgu, wd = (np.asarray(a, np.float64) for a in (x, w_gate_up, w_down))
    out = np.zeros(x.shape[:2] + (wd.shape[2],))
    for e, count in enumerate(np.clip(counts, 0, x.shape[1])):
        rows = x[e, :count]
        gate, up = rows @ wgu[e, :, 0], rows @ wgu[e, :, 1]
        out[e, :count] = (gate / (1 + np.exp(-gate)) * up) @ wd[e]
    return out


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


def test_jit_traces_once_per_shape():
    x, w_gate_up, w_down = _inputs(1, 21)
    fn = jax.jit(
        chex.assert_max_traces(
            lambda c: kernels.grouped_ffn(x, c, w_gate_up, w_down, impl="pallas", config=SMALL),
            n=1,
        )
    )
    for counts in ([1, 2, 3, 4], [21, 0, 0, 7]):
        fn(jnp.asarray(counts, jnp.int32))


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
    sharding = jax.sharding.NamedSharding(aot.gpu_mesh((1,), ("x",)), jax.sharding.PartitionSpec())
    shapes = [((300, 7168), jnp.bfloat16), ((4, 96), jnp.int32)] if gathered else []
    shapes += [] if gathered else [((4, 96, 7168), jnp.bfloat16)]
    shapes += [((4,), jnp.int32)]
    shapes += [((4, 7168, 2, 2048), jnp.bfloat16), ((4, 2048, 7168), jnp.bfloat16)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    kernel = functools.partial(
        grouped_gemm.grouped_ffn_pallas, max_rows=200, cfg=gemm_config.GROUPED_FFN, interpret=False
    )
    if gathered:
        kernel = functools.partial(
            lambda rows, slot_row, *rest, run: run(kernels.SlotRows(rows, slot_row), *rest),
            run=kernel,
        )
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    abstract = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=h200
    )
    with jax.sharding.use_abstract_mesh(abstract):  # Pallas asks it which GPU it lowers for
        hlo = jax.jit(kernel).lower(*args).compile().as_text()
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
