"""``flat_rows``: matrix rows of the attention kernels as rows of the flat query/output views,
checked against numpy indexing and, through a small Pallas kernel in the interpreter, the
loads, masked stores and padded-row zeroing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jtbo.attention import flat_rows


@pytest.mark.parametrize(("group", "q_heads"), [(1, 4), (4, 8), (8, 8)])
def test_flat_rows_match_the_token_head_layout(group, q_heads):
    # Row r of a tile starting at token 5, for KV head h, is query r // group and head
    # h * group + r % group: its place in [tokens, q_heads] flattened.
    rows = jnp.arange(3 * group, dtype=jnp.int32)
    for head in range(q_heads // group):
        got = np.asarray(flat_rows.flat_rows(5, head, rows, group=group, q_heads=q_heads))
        layout = np.arange(16 * q_heads).reshape(16, q_heads)
        want = [layout[5 + r // group, head * group + r % group] for r in range(3 * group)]
        np.testing.assert_array_equal(got, want)


def _copy_kernel(q_ref, num_tokens_ref, o_ref, *, group, q_heads, tokens, query_tile, zero):
    # One program per (tile, KV head): copies the tile's real rows, zeros its padded share.
    tile, head = pl.program_id(0), pl.program_id(1)
    row = jnp.arange(query_tile * group, dtype=jnp.int32)
    q_len = jnp.minimum(query_tile, num_tokens_ref[0] - tile * query_tile)
    flat = flat_rows.flat_rows(tile * query_tile, head, row, group=group, q_heads=q_heads)
    (values,) = flat_rows.load_rows(q_ref, flat, [(0, q_ref.shape[1])])
    flat_rows.store_rows(o_ref, flat, values * 2, jax.lax.div(row, group) < q_len)
    flat_rows.zero_padded_rows(
        o_ref, num_tokens_ref[0], tile, head, row, group=group, q_heads=q_heads, tokens=tokens,
        query_tile=query_tile, zero_per_tile=zero,
    )  # fmt: skip


@pytest.mark.parametrize("num_tokens", [7, 12, 16])
def test_rows_are_stored_once_and_padded_tokens_zeroed(num_tokens):
    # 16 tokens, 4 query heads in 2 groups of 2, tiles of 4 queries: the real tokens' rows
    # are doubled in place, every padded token's rows are zeroed, nothing else is written
    # (the output starts as NaN in the interpreter).
    tokens, q_heads, group, query_tile, dim = 16, 4, 2, 4, 8
    num_tiles = -(-num_tokens // query_tile)
    zero = flat_rows.zero_per_tile(tokens, num_tiles)
    q = jax.random.normal(jax.random.key(0), (tokens * q_heads, dim), jnp.float32) + 3.0
    kernel = functools.partial(
        _copy_kernel, group=group, q_heads=q_heads, tokens=tokens, query_tile=query_tile,
        zero=zero,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tokens * q_heads + flat_rows.SPARE_ROWS, dim), q.dtype),
        grid=(num_tiles, q_heads // group),
        interpret=True,
    )(q, jnp.array([num_tokens], jnp.int32))
    out = np.asarray(out[: tokens * q_heads]).reshape(tokens, q_heads, dim)
    want = np.asarray(q).reshape(tokens, q_heads, dim) * 2
    want[num_tokens:] = 0
    np.testing.assert_array_equal(out, want)
