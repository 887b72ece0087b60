"""CopyConfig validation, the alignment hint, block sizing, and every op under other configs."""

import jax.numpy as jnp
import numpy as np
import pytest

from jtbo import kernels
from tests.kernels import helpers


def test_align_is_gcd_of_row_and_vector():
    cfg = kernels.CopyConfig(vector_bytes=16)
    assert cfg.align(4096, 2) == 8  # bf16: 8 per 16-byte vector
    assert cfg.align(12, 2) == 4
    assert cfg.align(7, 4) == 1
    assert cfg.align(0, 4) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_elems", 100),
        ("block_elems", 8),
        ("num_warps", 3),
        ("vector_bytes", 32),
        ("xla_below_bytes", -1),
    ],
)
def test_bad_values_raise(field, value):
    with pytest.raises(ValueError, match=f"CopyConfig.{field}"):
        kernels.CopyConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("min_programs", -1), ("num_stages", 0), ("eviction_policy", "evict_sometimes")],
)
def test_other_bad_values_raise(field, value):
    with pytest.raises(ValueError, match=f"CopyConfig.{field}"):
        kernels.CopyConfig(**{field: value})


def test_block_for_keeps_large_blocks_on_large_copies():
    cfg = kernels.CopyConfig(block_elems=16384, num_warps=16, min_programs=528)
    assert cfg.block_for(32768 * 4096, 2) == 16384  # 256 MiB bf16: 8192 programs


def test_block_for_shrinks_to_fill_the_grid_but_not_below_one_vector_per_thread():
    cfg = kernels.CopyConfig(block_elems=16384, num_warps=16, min_programs=528)
    assert cfg.block_for(2048 * 4096, 2) == 8192  # 16 MiB: 1024 programs >= 528
    assert cfg.block_for(128 * 4096, 2) == 4096  # 1 MiB: floor = 16 warps x 32 x 8 bf16
    assert cfg.block_for(10, 2) == 4096


def test_block_for_never_grows_a_small_block_and_zero_disables():
    assert kernels.CopyConfig(block_elems=16, num_warps=1).block_for(10**6, 4) == 16
    cfg = kernels.CopyConfig(block_elems=16384, min_programs=0)
    assert cfg.block_for(100, 2) == 16384


def test_describe_names_non_default_knobs():
    assert kernels.CopyConfig(block_elems=4096, num_warps=8).describe() == "4096 x 8w"
    cfg = kernels.CopyConfig(num_stages=2, eviction_policy="evict_first")
    assert cfg.describe() == "16384 x 16w stages=2 evict_first"


CONFIGS = (
    kernels.CopyConfig(block_elems=32, num_warps=1, eviction_policy="evict_first"),
    # block_for halves 256 down to its floor, 32 (one float32 per thread), on these tiny copies.
    kernels.CopyConfig(block_elems=256, num_warps=1, vector_bytes=4, min_programs=8),
)


@pytest.mark.parametrize("impl", helpers.impls_here())
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.describe())
def test_every_op_is_exact_under_other_configs(impl, cfg):
    rng = np.random.default_rng(7)
    x = helpers.random_rows(rng, 9, (5,), np.float32)
    y = helpers.random_rows(rng, 6, (5,), np.float32)
    out = kernels.dp_memcpy(jnp.asarray(x), jnp.asarray(y), 2, 5, offset_src=False,
                            impl=impl, config=cfg)  # fmt: skip
    helpers.assert_equal(out, helpers.memcpy_np(x, y, 2, 5, False))
    out = kernels.slice_pad(jnp.asarray(x), 3, 7, capacity=8, impl=impl, config=cfg)
    helpers.assert_equal(out, helpers.slice_pad_np(x, 3, 7, 8))
    out = kernels.merge_rows([jnp.asarray(y), jnp.asarray(x)], [0, 4], [4, 9], out_len=11,
                             impl=impl, config=cfg)  # fmt: skip
    helpers.assert_equal(out, helpers.merge_np([y, x], [0, 4], [4, 9], 11))


def test_second_config_really_shrinks():
    assert CONFIGS[1].block_for(40, 4) == 32
