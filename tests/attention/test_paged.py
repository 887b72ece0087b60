"""The paged attention kernel against the native attention and an independent float64 reference.

On the CPU ``impl="pallas"`` runs the kernel in the Pallas interpreter (the interpret-mode
twin of every case); on a GPU (``JAX_PLATFORMS=cuda``) the same tests run the Triton kernel.
Shapes are tiny but the launch knobs are shrunk with them, so the cases still cover several
KV blocks per split, several splits, several row blocks and padded rows.
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import aot
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.attention import metadata, paged, tiling
from jtbo.kernels import impls
from tests.attention import scenarios

TOKENS, SEQS, CONTEXT, HEAD_DIM = 24, 4, 32, 16
ONE_SPLIT = paged.PagedAttentionConfig(block_kv=16, block_rows=16, max_kv_splits=1)
# 32 positions / 8 = up to 4 splits; the grid stays below min_programs, so all 3 are used.
THREE_SPLITS = paged.PagedAttentionConfig(
    block_kv=16, block_rows=16, max_kv_splits=3, min_split_kv=8
)


F32_ATOL, F32_RTOL = scenarios.f32_tolerance(2e-5), scenarios.f32_tolerance(1e-5)


def _make(seed, prefix, new, **kwargs):
    kwargs.setdefault("token_capacity", TOKENS)
    return scenarios.make(np.random.default_rng(seed), prefix, new, head_dim=HEAD_DIM, **kwargs)


@jax.jit
def _written(sc_cache, k, v, loc):
    return kv_cache_lib.write_kv(sc_cache, 1, loc, k, v)


def _pool_with_step(sc, md):
    """The scenario's pool with its new tokens written (what every impl attends over)."""
    loc = jnp.where(jnp.arange(sc.q.shape[0]) < sc.num_tokens, md.out_cache_loc, 0)
    return _written(sc.cache, jnp.asarray(sc.k), jnp.asarray(sc.v), loc)


_attend = jax.jit(paged.paged_attention, static_argnames=("scaling", "impl", "config"))


def _check(sc, md, config=ONE_SPLIT, atol=None):
    """Each kernel impl == float64 reference and == native (xla impl); returns the last
    kernel output."""
    cache = _pool_with_step(sc, md)
    scale = HEAD_DIM**-0.5
    ref = _attend(jnp.asarray(sc.q), cache, 1, md, scaling=scale, impl="xla")
    atol = F32_ATOL if atol is None else atol
    for impl in scenarios.KERNEL_IMPLS:
        out = _attend(jnp.asarray(sc.q), cache, 1, md, scaling=scale, impl=impl, config=config)
        scenarios.assert_kernel_output(out, sc.expected, ref, atol=atol, rtol=F32_RTOL, impl=impl)
    return out


def _decode_md(sc, seqs=None):
    n = sc.prefix_lens.shape[0]
    return tiling.build_metadata(
        metadata.decode_capacity(seqs or n, CONTEXT),
        req=sc.req_pool_indices, q_start=np.arange(n), q_len=np.ones(n, int),
        q_pos=sc.prefix_lens, kv_len=sc.prefix_lens + 1, out_cache_loc=sc.out_cache_loc,
        num_tokens=n,
    )  # fmt: skip


def _extend_md(sc, query_tile=4):
    starts = np.cumsum(sc.extend_lens) - sc.extend_lens
    return tiling.build_metadata(
        metadata.extend_capacity(TOKENS, SEQS, CONTEXT, query_tile=query_tile),
        req=sc.req_pool_indices, q_start=starts, q_len=sc.extend_lens, q_pos=sc.prefix_lens,
        kv_len=sc.prefix_lens + sc.extend_lens, out_cache_loc=sc.out_cache_loc,
        num_tokens=sc.num_tokens,
    )  # fmt: skip


@pytest.mark.parametrize("config", [ONE_SPLIT, THREE_SPLITS], ids=["one_split", "three_splits"])
def test_decode_scattered_pages_one_token_and_max_context(config):
    # Slots are a random permutation of the pool; sequence 1 is one token long (no prefix),
    # sequence 2 fills max_context; 6 tiles for 4 sequences leave padded tiles.
    sc = _make(4, [6, 0, CONTEXT - 1, 12], [1, 1, 1, 1], token_capacity=6)
    out = _check(sc, _decode_md(sc, seqs=6), config=config)
    assert not np.asarray(out[sc.num_tokens :]).any()


@pytest.mark.parametrize("impl", scenarios.KERNEL_IMPLS)
def test_empty_metadata_gives_zeros(impl):
    sc = _make(6, [3, 5], [1, 1], token_capacity=4)
    md = metadata.empty_metadata(metadata.decode_capacity(4, CONTEXT))
    out = _attend(jnp.asarray(sc.q), sc.cache, 1, md, scaling=0.25, impl=impl, config=ONE_SPLIT)
    assert out.shape == (4, 4, HEAD_DIM)
    assert not np.asarray(out).any()


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (6, 2)])  # 8:1 in the row-block test
def test_gqa_ratios(q_heads, kv_heads):
    sc = _make(q_heads * 10 + kv_heads, [5, 0, 9], [1, 1, 1], token_capacity=3,
               q_heads=q_heads, kv_heads=kv_heads)  # fmt: skip
    _check(sc, _decode_md(sc))


@settings(max_examples=4, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 6)), min_size=1, max_size=SEQS),
    seed=st.integers(0, 2**31 - 1),
)
def test_extend_ragged_with_prefixes(lens, seed):
    # query_tile 4 x group 2 = 8 rows per tile, padded to one 16-row block.
    prefix, new = (np.array(x) for x in zip(*lens, strict=True))
    sc = _make(seed, prefix, new)
    out = _check(sc, _extend_md(sc), config=THREE_SPLITS)
    assert not np.asarray(out[sc.num_tokens :]).any()


@pytest.mark.parametrize("config", [ONE_SPLIT, THREE_SPLITS], ids=["one_split", "three_splits"])
def test_extend_after_a_long_prefix_skips_the_mask_on_whole_blocks(config):
    # Prefixes of 19 and 26 positions: the first 16-position block is seen whole by every
    # query row (the unmasked loop), the blocks after it hold the causal edge (the masked
    # one); with three splits each split starts its own unmasked run.
    sc = _make(21, [19, 26], [5, 6])
    out = _check(sc, _extend_md(sc), config=config)
    assert not np.asarray(out[sc.num_tokens :]).any()


def test_extend_rows_over_several_row_blocks():
    # query_tile 4 x group 8 = 32 rows: two row blocks of 16, each with its own causal end.
    sc = _make(12, [5, 0], [7, 9], q_heads=8, kv_heads=1)
    _check(sc, _extend_md(sc))


@pytest.mark.parametrize("draft", [2, 4])
def test_verify_causal_among_drafts(draft):
    # Each sequence verifies `draft` tokens after its prefix, causal among themselves: the
    # causal rule on tiles of `draft` rows.
    n = 3
    sc = _make(20 + draft, [4, 11, 0], [draft] * n)
    md = tiling.build_metadata(
        metadata.extend_capacity(TOKENS, SEQS, CONTEXT, query_tile=draft),
        req=sc.req_pool_indices, q_start=np.arange(n) * draft, q_len=np.full(n, draft),
        q_pos=sc.prefix_lens, kv_len=sc.prefix_lens + draft, out_cache_loc=sc.out_cache_loc,
        num_tokens=n * draft,
    )  # fmt: skip
    _check(sc, md, config=THREE_SPLITS)


@pytest.mark.parametrize("draft", [3])
def test_verify_custom_mask(draft):
    # TARGET_VERIFY metadata: random EAGLE masks over prefix + drafts; 4 tiles, 3 real.
    n = 3
    sc = _make(30 + draft, [4, 11, 0], [draft] * n, token_capacity=4 * draft, custom_mask=True)
    md = tiling.build_metadata(
        metadata.verify_capacity(4, draft, CONTEXT),
        req=sc.req_pool_indices, q_start=np.arange(n) * draft, q_len=np.full(n, draft),
        q_pos=sc.prefix_lens, kv_len=sc.prefix_lens + draft, out_cache_loc=sc.out_cache_loc,
        num_tokens=n * draft, mask_rows=sc.mask_rows,
    )  # fmt: skip
    _check(sc, md, config=THREE_SPLITS)


@pytest.mark.parametrize("impl", scenarios.KERNEL_IMPLS)
def test_bf16_pool_close_to_float64_and_native(impl):
    sc = _make(7, [7, 3, 30], [1, 1, 1], token_capacity=3)
    md = _decode_md(sc)
    cache = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, _pool_with_step(sc, md)
    )
    q = jnp.asarray(sc.q, jnp.bfloat16)
    out = _attend(q, cache, 1, md, scaling=0.25, impl=impl, config=THREE_SPLITS)
    ref = _attend(q, cache, 1, md, scaling=0.25, impl="xla")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64), sc.expected, atol=5e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2)


@pytest.mark.parametrize("impl", scenarios.KERNEL_IMPLS)
def test_forward_writes_the_step_and_takes_a_traced_layer(impl):
    sc = _make(8, [2, 5], [1, 1], token_capacity=2)
    md = _decode_md(sc)
    fwd = jax.jit(paged.forward, static_argnames=("impl", "config"))
    out, cache = fwd(sc.q, sc.k, sc.v, jnp.int32(1), md, sc.cache, impl=impl, config=ONE_SPLIT)
    np.testing.assert_allclose(np.asarray(out, np.float64), sc.expected, atol=F32_ATOL)
    np.testing.assert_array_equal(np.asarray(cache.k[1, sc.out_cache_loc]), sc.k)


def test_impl_choice_and_errors():
    sc = _make(9, [2], [1], token_capacity=1)
    md = _decode_md(sc)
    q = jnp.asarray(sc.q)
    if jax.default_backend() == "cpu":
        assert impls.resolve(None, op=paged.OP) == "xla"
        with pytest.raises(impls.KernelUnavailableError, match="impl='triton'.*GPUs only"):
            paged.paged_attention(q, sc.cache, 1, md, scaling=0.25, impl="triton")
    with pytest.raises(ValueError, match="impl must be one of"):
        paged.paged_attention(q, sc.cache, 1, md, scaling=0.25, impl="cuda")
    with pytest.raises(ValueError, match="kv_heads"):
        paged.paged_attention(q[:, :3], sc.cache, 1, md, scaling=0.25, impl="pallas")


@pytest.mark.parametrize(
    ("field", "value"), [("block_kv", 24), ("block_kv", 8), ("block_rows", 8), ("num_warps", 3),
                         ("max_kv_splits", 0), ("num_stages", 0)],
)  # fmt: skip
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"PagedAttentionConfig.{field}"):
        paged.PagedAttentionConfig(**{field: value})


def _h200_program(capacity, n, ctx, kv_heads, q_heads, key_width, value_width) -> str:
    """The paged kernel's program compiled for an H200 on the CPU (abstract inputs)."""
    mesh = aot.gpu_mesh((1,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    slots = n * ctx + 1
    cache = kv_cache_lib.KVCache(
        k=spec((1, slots, kv_heads, key_width), jnp.bfloat16),
        v=spec((1, slots, kv_heads, value_width), jnp.bfloat16),
        req_to_token=spec((n, ctx), jnp.int32),
    )
    tiles = [spec((capacity.num_tiles,), jnp.int32) for _ in range(5)]
    mask = spec((n, 4, ctx), jnp.bool_) if capacity.custom_mask else None
    md = metadata.AttentionMetadata(
        *tiles, out_cache_loc=spec((capacity.token_capacity,), jnp.int32),
        num_tokens=spec((), jnp.int32), custom_mask=mask, capacity=capacity,
    )  # fmt: skip
    q = spec((capacity.token_capacity, q_heads, key_width), jnp.bfloat16)
    fn = jax.jit(
        lambda q, cache, md: paged.paged_attention_pallas(
            q,
            cache,
            0,
            md,
            scaling=key_width**-0.5,
            config=paged.DEFAULT_CONFIG,
            interpret=False,
        )  # fmt: skip
    )
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return fn.lower(q, cache, md).compile().as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compiles for an H200 on the CPU")
@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_lowers_for_an_h200_without_a_gathered_kv_copy(kind):
    # Compiled for an H200 on the CPU: the Triton kernel is one custom call, and no other
    # instruction of the program is anywhere near the size of the K/V it reads.
    n, ctx, kv_heads, d = 64, 1024, 8, 128
    capacity = metadata.decode_capacity(n, ctx)
    if kind == "verify":
        capacity = metadata.verify_capacity(n, 4, ctx)
    hlo = _h200_program(capacity, n, ctx, kv_heads, 32, d, d)
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 1
    assert _largest_result(hlo) < n * ctx * kv_heads * d // 16


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compiles for an H200 on the CPU")
def test_one_split_reads_queries_and_stores_rows_in_place_on_an_h200():
    # 256 decode tiles x 8 KV heads fill the grid in one split: the program is the kernel
    # alone, with no gather of queries and no scatter, merge or zero fill of the output.
    n, ctx, kv_heads, d = 256, 1024, 8, 128
    capacity = metadata.decode_capacity(n, ctx)
    assert paged._launch(paged.DEFAULT_CONFIG, capacity, kv_heads, 4, d, None).splits == 1
    hlo = _h200_program(capacity, n, ctx, kv_heads, 32, d, d)
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 1
    assert not re.search(r" (gather|scatter|broadcast|reduce|transpose)\(", hlo)


def test_latent_pool_launches_one_split_per_sequence_where_heads_pools_split():
    # One latent KV head makes one program per decode sequence: DEFAULT_CONFIG would split a
    # batch of 128 contexts 4 ways into partial rows; LATENT_CONFIG stores the rows in place.
    capacity = metadata.decode_capacity(128, 1024)
    rank, rope = 512, 64
    default = paged._launch(paged.DEFAULT_CONFIG, capacity, 1, 16, rank + rope, rank)
    latent = paged._launch(paged.LATENT_CONFIG, capacity, 1, 16, rank + rope, rank)
    assert (default.splits, default.stores_rows) == (4, False)
    assert (latent.splits, latent.stores_rows) == (1, True)
    # A small batch still splits to fill the GPU.
    assert paged._launch(paged.LATENT_CONFIG, metadata.decode_capacity(16, 1024), 1, 16,
                         rank + rope, rank).splits == 4  # fmt: skip


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compiles for an H200 on the CPU")
def test_lowers_for_an_h200_with_mla_decompressed_widths():
    # MLA's decompressed keys are 128 + 64 columns wide, its values 128: the key is loaded
    # and multiplied in two power-of-two parts, and the kernel lowers for an H200.
    assert paged.key_parts(192, None) == ((0, 128), (128, 64))
    assert paged.key_parts(576, 512) == ((0, 512), (512, 64))
    capacity = metadata.extend_capacity(512, 4, 512)
    hlo = _h200_program(capacity, 4, 512, 16, 16, 192, 128)
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 1


def _largest_result(hlo: str) -> int:
    """Elements of the largest array an instruction other than a parameter produces."""
    largest = 0
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) [\w-]+\(", line)
        if match is None or "parameter(" in line:
            continue
        for dims in re.findall(r"\[([\d,]*)\]", match.group(1)):
            largest = max(largest, int(np.prod([int(x) for x in dims.split(",") if x])))
    return largest


def test_a_jitted_caller_traces_once_in_a_fresh_process():
    # The interpreter's first lowering must not change jax's tracing context (module
    # comment in paged.py): a fresh process, one program, called twice, traced once.
    code = """
import jax, jax.numpy as jnp
from jtbo.attention import kv_cache, metadata, paged
cap = metadata.decode_capacity(2, 32)
md = metadata.empty_metadata(cap)
zeros = jnp.zeros((1, 4, 1, 16), jnp.float32)
cache = kv_cache.KVCache(k=zeros, v=zeros, req_to_token=jnp.zeros((2, 32), jnp.int32))
traces = []
def attend(q, c):
    traces.append(1)
    return paged.paged_attention(q, c, 0, md, scaling=1.0, impl="pallas")
step = jax.jit(attend)
q = jnp.ones((2, 1, 16))
step(q, cache).block_until_ready()
step(q, cache).block_until_ready()
assert len(traces) == 1, f"traced {len(traces)} times"
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ), timeout=120)


def test_the_triton_kernels_take_a_key_in_at_most_two_parts():
    # 224 = 128 + 64 + 32: the Pallas kernels load three parts, the Triton ones two at most.
    q = jnp.zeros((2, 2, 224), jnp.float32)
    cache = scenarios.zero_cache(1, 4, 2, 224, 2, CONTEXT, v_head_dim=128)
    assert paged.unavailable_reason(q, cache) is None
    assert "two" in paged.unavailable_reason(q, cache, impl="triton")
    assert paged.triton_parts(paged.key_parts(576, 512)) == (512, 64)  # MLA's latent row
    assert paged.triton_parts(paged.key_parts(128, None)) == (128, 0)
    assert paged.triton_precision(jnp.float32) == "ieee"


def test_triton_stages_fit_the_staged_kv_blocks_in_shared_memory():
    # GQA heads of 128: two stages of 64 K/V rows fit; MLA's latent rows (512 + 64 key and
    # 512 value columns) fit one; 1024 rows of them none.
    assert paged.triton_stages(2, 64, 256, 2) == 2
    assert paged.triton_stages(2, 64, 512 + 64 + 512, 2) == 1
    with pytest.raises(impls.KernelUnavailableError, match="lower block_kv"):
        paged.triton_stages(2, 1024, 512 + 64 + 512, 2)
