"""Native blocked attention vs an independent float64 reference, for every mode."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.attention import metadata, native, tiling
from tests.attention import scenarios

TOKENS, SEQS, CONTEXT = 24, 4, 32
EXTEND = metadata.extend_capacity(TOKENS, SEQS, CONTEXT, query_tile=4)
CONFIG = native.NativeAttentionConfig(kv_block=8)
_forward = jax.jit(native.forward, static_argnames=("scaling", "config"))


def _extend_metadata(sc, capacity=EXTEND):
    starts = np.cumsum(sc.extend_lens) - sc.extend_lens
    return tiling.build_metadata(
        capacity,
        req=sc.req_pool_indices,
        q_start=starts,
        q_len=sc.extend_lens,
        q_pos=sc.prefix_lens,
        kv_len=sc.prefix_lens + sc.extend_lens,
        out_cache_loc=sc.out_cache_loc,
        num_tokens=sc.num_tokens,
        mask_rows=sc.mask_rows,
    )


def _check(sc, md, config=CONFIG, atol=2e-5):
    out, cache = _forward(sc.q, sc.k, sc.v, 1, md, sc.cache, config=config)
    np.testing.assert_allclose(np.asarray(out, np.float64), sc.expected, atol=atol, rtol=1e-5)
    # The new tokens landed in the pool of layer 1 only.
    np.testing.assert_array_equal(np.asarray(cache.k[1, sc.out_cache_loc]), sc.k[: sc.num_tokens])
    np.testing.assert_array_equal(np.asarray(cache.k[0]), np.asarray(sc.cache.k[0]))
    return out


@settings(max_examples=12, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 6)), min_size=1, max_size=SEQS),
    seed=st.integers(0, 2**31 - 1),
)
def test_extend_ragged_with_prefixes_matches_float64(lens, seed):
    prefix, new = (np.array(x) for x in zip(*lens, strict=True))
    sc = scenarios.make(np.random.default_rng(seed), prefix, new, token_capacity=TOKENS)
    out = _check(sc, _extend_metadata(sc))
    # Poisoned padding rows (random q/k/v past num_tokens) come out as exact zeros.
    assert not np.asarray(out[sc.num_tokens :]).any()


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (6, 2), (4, 1)])
def test_gqa_and_mha(q_heads, kv_heads):
    sc = scenarios.make(
        np.random.default_rng(q_heads * 10 + kv_heads), [5, 0, 9], [3, 7, 2],
        token_capacity=TOKENS, q_heads=q_heads, kv_heads=kv_heads,
    )  # fmt: skip
    _check(sc, _extend_metadata(sc))


def test_kv_block_not_dividing_context_and_long_sequence():
    sc = scenarios.make(np.random.default_rng(3), [20, 1], [11, 2], token_capacity=TOKENS)
    _check(sc, _extend_metadata(sc), config=native.NativeAttentionConfig(kv_block=5))


@pytest.mark.parametrize("decode_kv_block", [5, 8, 1024])
def test_decode_matches_float64(decode_kv_block):
    # 5 and 8 split the 31-long sequence over several blocks; 1024 is one block (clamped to
    # max_context).
    sc = scenarios.make(np.random.default_rng(4), [6, 0, 30, 12], [1, 1, 1, 1], token_capacity=4)
    md = tiling.build_metadata(
        metadata.decode_capacity(4, CONTEXT),
        req=sc.req_pool_indices,
        q_start=np.arange(4),
        q_len=np.ones(4, int),
        q_pos=sc.prefix_lens,
        kv_len=sc.prefix_lens + 1,
        out_cache_loc=sc.out_cache_loc,
        num_tokens=4,
    )
    config = native.NativeAttentionConfig(kv_block=8, decode_kv_block=decode_kv_block)
    _check(sc, md, config=config)


def test_decode_tiles_take_the_decode_block_and_other_tiles_the_kv_block():
    config = native.NativeAttentionConfig(kv_block=16, decode_kv_block=512)
    assert native.block_size(config, metadata.decode_capacity(8, 4096)) == 512
    assert native.block_size(config, metadata.decode_capacity(8, 100)) == 100
    assert native.block_size(config, EXTEND) == 16
    assert native.block_size(config, metadata.verify_capacity(4, 3, 4096)) == 16


def test_target_verify_random_custom_mask_matches_float64():
    draft = 3
    sc = scenarios.make(
        np.random.default_rng(5), [4, 11, 0], [draft] * 3, token_capacity=9, custom_mask=True
    )
    md = tiling.build_metadata(
        metadata.verify_capacity(3, draft, CONTEXT),
        req=sc.req_pool_indices,
        q_start=np.arange(3) * draft,
        q_len=np.full(3, draft),
        q_pos=sc.prefix_lens,
        kv_len=sc.prefix_lens + draft,
        out_cache_loc=sc.out_cache_loc,
        num_tokens=9,
        mask_rows=sc.mask_rows,
    )
    _check(sc, md)


@settings(max_examples=8, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 6)), min_size=1, max_size=SEQS),
    chunk_rows=st.sampled_from([1, 4, 8, 12, 20]),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunked_tiles_match_float64_and_the_unchunked_result_exactly(lens, chunk_rows, seed):
    # EXTEND has 9 tiles of 4 rows: chunks of 1, 2, 3 and 5 tiles (the last one shifted back
    # over tiles already done), run only up to the last real tile.
    prefix, new = (np.array(x) for x in zip(*lens, strict=True))
    sc = scenarios.make(np.random.default_rng(seed), prefix, new, token_capacity=TOKENS)
    md = _extend_metadata(sc)
    chunked = _check(sc, md, config=native.NativeAttentionConfig(kv_block=8, chunk_rows=chunk_rows))
    whole = _check(sc, md, config=native.NativeAttentionConfig(kv_block=8, chunk_rows=10**6))
    np.testing.assert_array_equal(np.asarray(chunked), np.asarray(whole))
    assert not np.asarray(chunked[sc.num_tokens :]).any()


def test_chunked_tiles_with_custom_mask_match_float64():
    draft = 3
    sc = scenarios.make(
        np.random.default_rng(11), [4, 11, 0, 2], [draft] * 4, token_capacity=15,
        custom_mask=True,
    )  # fmt: skip
    md = tiling.build_metadata(
        metadata.verify_capacity(5, draft, CONTEXT),  # the 5th tile is empty
        req=sc.req_pool_indices, q_start=np.arange(4) * draft, q_len=np.full(4, draft),
        q_pos=sc.prefix_lens, kv_len=sc.prefix_lens + draft, out_cache_loc=sc.out_cache_loc,
        num_tokens=12, mask_rows=sc.mask_rows,
    )  # fmt: skip
    _check(sc, md, config=native.NativeAttentionConfig(kv_block=8, chunk_rows=2 * draft))


def test_bf16_pool_close_to_float64():
    sc = scenarios.make(np.random.default_rng(6), [7, 3], [5, 4], token_capacity=TOKENS)
    cache = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x,
                         sc.cache)  # fmt: skip
    q = jnp.asarray(sc.q, jnp.bfloat16)
    out, _ = _forward(q, jnp.asarray(sc.k, jnp.bfloat16), jnp.asarray(sc.v, jnp.bfloat16), 1,
                      _extend_metadata(sc), cache, config=CONFIG)  # fmt: skip
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64), sc.expected, atol=5e-2)


def test_one_trace_per_capacity():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(q, k, v, md, cache):
        return native.forward(q, k, v, 1, md, cache, config=CONFIG)

    for seed, (prefix, new) in enumerate([([1], [5]), ([0, 4, 2], [2, 2, 9]), ([9, 9], [1, 12])]):
        sc = scenarios.make(np.random.default_rng(seed), prefix, new, token_capacity=TOKENS)
        out, _ = step(sc.q, sc.k, sc.v, _extend_metadata(sc), sc.cache)
        np.testing.assert_allclose(np.asarray(out, np.float64), sc.expected, atol=2e-5)


def test_layer_id_may_be_traced():
    sc = scenarios.make(np.random.default_rng(8), [2, 5], [4, 3], token_capacity=TOKENS)
    out, _ = _forward(sc.q, sc.k, sc.v, jnp.int32(1), _extend_metadata(sc), sc.cache, config=CONFIG)
    np.testing.assert_allclose(np.asarray(out, np.float64), sc.expected, atol=2e-5)


def test_working_set_is_bounded_by_the_kv_block():
    # No intermediate of the program may hold tokens x max_context x heads elements.
    context = 256
    sc = scenarios.make(
        np.random.default_rng(9), [20], [10], token_capacity=TOKENS, max_context=context
    )
    md = _extend_metadata(sc, metadata.extend_capacity(TOKENS, SEQS, context, query_tile=4))
    hlo = _forward.lower(sc.q, sc.k, sc.v, 1, md, sc.cache, config=CONFIG).as_text()
    shapes = re.findall(r"tensor<((?:\d+x)+)f32>", hlo)
    largest = max(int(np.prod([int(d) for d in s.split("x") if d])) for s in shapes)
    assert largest < TOKENS * context, (largest, TOKENS * context)


def test_shape_errors_are_value_errors():
    sc = scenarios.make(np.random.default_rng(10), [1], [2], token_capacity=TOKENS)
    md = _extend_metadata(sc)
    with pytest.raises(ValueError, match="token_capacity"):
        native.forward(sc.q[:10], sc.k[:10], sc.v[:10], 1, md, sc.cache)
    with pytest.raises(ValueError, match="kv_heads"):
        native.forward(sc.q[:, :3], sc.k, sc.v, 1, md, sc.cache)
    with pytest.raises(ValueError, match="kv_block"):
        native.NativeAttentionConfig(kv_block=0)
    with pytest.raises(ValueError, match="chunk_rows"):
        native.NativeAttentionConfig(chunk_rows=0)
    with pytest.raises(ValueError, match="decode_kv_block"):
        native.NativeAttentionConfig(decode_kv_block=0)
