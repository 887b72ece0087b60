"""The two-stage extend kernel against the native attention and a float64 reference.

On the CPU ``impl="pallas"`` runs the kernel in the Pallas interpreter (the interpret-mode
twin of every case); on a GPU (``JAX_PLATFORMS=cuda``) the same tests run the Triton kernel.
The launch knobs are shrunk with the shapes, so the cases cover several prefix and extend
blocks, whole and masked ones, several row blocks and padded rows.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import aot
from jtbo.attention import extend, metadata, tiling
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.kernels import impls
from tests.attention import scenarios

TOKENS, SEQS, CONTEXT, HEAD_DIM = 24, 4, 32, 16
SMALL = extend.ExtendAttentionConfig(block_kv=16, block_rows=16, num_warps=4, num_stages=2)
F32_ATOL, F32_RTOL = scenarios.f32_tolerance(2e-5), scenarios.f32_tolerance(1e-5)
POISON = 1e4


def _make(seed, prefix, new, **kwargs):
    kwargs.setdefault("token_capacity", TOKENS)
    kwargs.setdefault("num_slots", 128)
    return scenarios.make(np.random.default_rng(seed), prefix, new, head_dim=HEAD_DIM, **kwargs)


def _extend_md(sc, query_tile=4, seqs=SEQS):
    starts = np.cumsum(sc.extend_lens) - sc.extend_lens
    return tiling.build_metadata(
        metadata.extend_capacity(sc.q.shape[0], seqs, CONTEXT, query_tile=query_tile),
        req=sc.req_pool_indices, q_start=starts, q_len=sc.extend_lens, q_pos=sc.prefix_lens,
        kv_len=sc.prefix_lens + sc.extend_lens, out_cache_loc=sc.out_cache_loc,
        num_tokens=sc.num_tokens,
    )  # fmt: skip


_forward = jax.jit(extend.forward, static_argnames=("scaling", "impl", "config"))


def _poisoned(sc):
    """The step's K/V with their padding rows (past ``num_tokens``) set to a huge value: a
    kernel that reads them, or that reads the new tokens from the wrong rows, fails."""
    pad = np.arange(sc.q.shape[0]) >= sc.num_tokens
    k, v = (np.where(pad[:, None, None], POISON, x).astype(x.dtype) for x in (sc.k, sc.v))
    return jnp.asarray(k), jnp.asarray(v)


def _check(sc, md, config=SMALL, atol=None):
    """Each kernel impl == float64 reference and == native (xla impl); returns the last
    kernel output."""
    k, v = _poisoned(sc)
    q = jnp.asarray(sc.q)
    ref, ref_cache = _forward(q, k, v, 1, md, sc.cache, impl="xla")
    atol = F32_ATOL if atol is None else atol
    for impl in scenarios.KERNEL_IMPLS:
        out, cache = _forward(q, k, v, 1, md, sc.cache, impl=impl, config=config)
        # The kernel's own K/V write leaves the pools exactly as the reference's scatter.
        chex.assert_trees_all_equal(cache, ref_cache)
        scenarios.assert_kernel_output(out, sc.expected, ref, atol=atol, rtol=F32_RTOL, impl=impl)
        np.testing.assert_array_equal(
            np.asarray(cache.k[1, sc.out_cache_loc]), sc.k[: sc.num_tokens]
        )
        assert not np.asarray(out[sc.num_tokens :]).any(), impl
    return out


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 6)), min_size=1, max_size=SEQS),
    seed=st.integers(0, 2**31 - 1),
)
def test_ragged_prefixes_and_new_tokens(lens, seed):
    # Prefixes up to 20 positions (two 16-position blocks, the second partial) and up to 6
    # new tokens per sequence in tiles of 4: the second tile of a sequence sees the first
    # tile's tokens whole.
    prefix, new = (np.array(x) for x in zip(*lens, strict=True))
    sc = _make(seed, prefix, new)
    _check(sc, _extend_md(sc))


def test_long_fresh_prompts_cross_whole_and_masked_extend_blocks():
    # 23 and 1 new tokens, no prefix, query tile 8 x group 2 = 16 rows per program: the
    # first prompt's third tile (queries 16-22) sees tokens 0-15 as one whole block, then one
    # masked block; its second tile (queries 8-15) has only a masked block.
    sc = _make(3, [0, 0], [23, 1])
    _check(sc, _extend_md(sc, query_tile=8))


def test_rows_over_several_row_blocks_and_a_decode_like_tile():
    # query_tile 4 x group 8 = 32 rows: two row blocks of 16, each with its own causal end;
    # the second sequence is one token after a long prefix (a MIXED step's decode row).
    sc = _make(12, [5, 27], [7, 1], q_heads=8, kv_heads=1)
    _check(sc, _extend_md(sc))


@pytest.mark.parametrize("impl", scenarios.KERNEL_IMPLS)
def test_bf16_close_to_float64_and_native(impl):
    sc = _make(7, [9, 0, 17], [5, 12, 3])
    md = _extend_md(sc)
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    cache = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x,
                         sc.cache)  # fmt: skip
    args = (bf16(sc.q), bf16(sc.k), bf16(sc.v), 1, md, cache)
    out, _ = _forward(*args, impl=impl, config=SMALL)
    ref, _ = _forward(*args, impl="xla")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64), sc.expected, atol=6e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


@pytest.mark.parametrize("impl", scenarios.KERNEL_IMPLS)
def test_empty_metadata_gives_zeros(impl):
    sc = _make(6, [3, 5], [2, 2], token_capacity=8)
    md = metadata.empty_metadata(metadata.extend_capacity(8, 2, CONTEXT, query_tile=4))
    out, _ = _forward(sc.q, sc.k, sc.v, 1, md, sc.cache, impl=impl, config=SMALL)
    assert out.shape == (8, 4, HEAD_DIM)
    assert not np.asarray(out).any()


def test_padded_rows_are_zeroed_when_tiles_are_few():
    # 5 tiles of 2 queries for 24 token rows: each tile's programs zero 5 padded tokens' rows
    # in 3 chunks of the tile's 2 queries (the output starts uninitialized: NaN in the
    # interpreter).
    sc = _make(13, [3, 0], [3, 2], token_capacity=24)
    capacity = metadata.AttentionCapacity(
        token_capacity=24, seq_capacity=2, query_tile=2, num_tiles=5, max_context=CONTEXT
    )
    md = tiling.build_metadata(
        capacity, req=sc.req_pool_indices, q_start=[0, 3], q_len=sc.extend_lens,
        q_pos=sc.prefix_lens, kv_len=sc.prefix_lens + sc.extend_lens,
        out_cache_loc=sc.out_cache_loc, num_tokens=sc.num_tokens,
    )  # fmt: skip
    _check(sc, md)


def test_impl_choice_and_errors():
    sc = _make(9, [2], [3], token_capacity=4)
    md = _extend_md(sc)
    q, k, v = (jnp.asarray(x) for x in (sc.q, sc.k, sc.v))
    attend = extend.extend_attention
    if jax.default_backend() == "cpu":
        assert impls.resolve(None, op=extend.OP) == "xla"
        with pytest.raises(impls.KernelUnavailableError, match="impl='triton'.*GPUs only"):
            attend(q, k, v, sc.cache, 1, md, scaling=0.25, impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        attend(q, k, v, sc.cache, 1, md, scaling=0.25, impl="cuda")
    with pytest.raises(ValueError, match="kv_heads"):
        attend(q[:, :3], k, v, sc.cache, 1, md, scaling=0.25, impl="pallas")
    with pytest.raises(ValueError, match="pool's rows"):
        attend(q, k[..., :8], v, sc.cache, 1, md, scaling=0.25, impl="pallas")
    verify = metadata.empty_metadata(metadata.verify_capacity(2, 2, CONTEXT))
    with pytest.raises(ValueError, match="custom-mask"):
        attend(q, k, v, sc.cache, 1, verify, scaling=0.25, impl="pallas")


@pytest.mark.parametrize(
    ("field", "value"), [("block_kv", 24), ("block_kv", 8), ("block_rows", 8), ("num_warps", 3),
                         ("num_stages", 0)],
)  # fmt: skip
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"ExtendAttentionConfig.{field}"):
        extend.ExtendAttentionConfig(**{field: value})


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compiles for an H200 on the CPU")
def test_lowers_for_an_h200_as_one_kernel_without_gathers():
    # Compiled for an H200 on the CPU: the Triton kernel is one custom call, and the program
    # gathers, scatters or transposes nothing larger than the tiles' metadata (no copy of the
    # queries, keys or output rows).
    mesh = aot.gpu_mesh((1,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    tokens, n, ctx, kv_heads, q_heads, d = 4096, 2, 4096, 8, 32, 128
    capacity = metadata.extend_capacity(tokens, n, ctx)
    cache = kv_cache_lib.KVCache(
        k=spec((1, n * ctx + 1, kv_heads, d), jnp.bfloat16),
        v=spec((1, n * ctx + 1, kv_heads, d), jnp.bfloat16),
        req_to_token=spec((n, ctx), jnp.int32),
    )
    tiles = [spec((capacity.num_tiles,), jnp.int32) for _ in range(5)]
    md = metadata.AttentionMetadata(
        *tiles, out_cache_loc=spec((tokens,), jnp.int32), num_tokens=spec((), jnp.int32),
        custom_mask=None, capacity=capacity,
    )  # fmt: skip
    q = spec((tokens, q_heads, d), jnp.bfloat16)
    kv = spec((tokens, kv_heads, d), jnp.bfloat16)
    fn = jax.jit(
        lambda q, k, v, cache, md: extend.extend_attention_pallas(
            q,
            k,
            v,
            cache,
            0,
            md,
            scaling=d**-0.5,
            config=extend.DEFAULT_CONFIG,
            interpret=False,
        ),  # fmt: skip
        donate_argnums=(3,),
    )
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = fn.lower(q, kv, kv, cache, md).compile().as_text()
    # One kernel attends and writes the step's K/V: no scatter into the pool beside it.
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 1
    moved = [
        int(np.prod([int(x) for x in dims.split(",") if x]))
        for line in hlo.splitlines()
        if re.search(r" (gather|scatter|transpose|copy)\(", line)
        for dims in re.findall(r"= \w+\[([\d,]*)\]", line)
    ]
    # Only the tiles' metadata is gathered; the donated pools are written in place (no copy).
    assert max(moved, default=0) <= capacity.num_tiles
