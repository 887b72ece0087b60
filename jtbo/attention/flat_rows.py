"""Matrix rows of the attention kernels as rows of the flat ``[tokens * q_heads, dim]`` views.

The extend and paged Pallas kernels fold a KV head's group of query heads into their matrix
rows: row ``r`` of a tile is query ``r // group`` and head ``r % group`` of the KV head's
group. Row ``r`` of tile ``t`` (first token ``q_start``) and KV head ``h`` is then flat row
``(q_start + r // group) * q_heads + h * group + r % group`` of the queries and of the output,
so the kernels load their queries and store their results there directly: XLA neither
gathers queries into tiles nor scatters rows back.

Rows past a tile's queries are loaded from a clamped row (their results are not stored) and
stored nowhere. Padded tokens (from ``num_tokens`` on) belong to no tile; every tile's
programs zero a share of their rows (``zero_padded_rows``), so the output needs no zero fill.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SPARE_ROWS = 1
"""Output rows past the tokens' in the interpreter, for masked-off stores (``store_rows``)."""


def flat_rows(q_start, head, row, *, group: int, q_heads: int):
    """Flat rows of matrix rows ``row`` (``[block_rows]``) of a tile starting at token
    ``q_start``, for KV head ``head``."""
    return (q_start + lax.div(row, group)) * q_heads + head * group + lax.rem(row, group)


def load_rows(ref, flat_row, parts):
    """Columns ``parts`` (``(offset, width)`` pairs) of rows ``flat_row`` of ``ref``, rows past
    the array clamped to its last one: one ``[block_rows, width]`` block per part."""
    row = jnp.minimum(flat_row, ref.shape[0] - 1)
    return [ref[row, pl.ds(offset, width)] for offset, width in parts]


def store_rows(o_ref, flat_row, values, row_ok):
    """Stores ``values`` at output rows ``flat_row`` where ``row_ok``.

    Rows past the output are clamped to its last row and masked off. The interpreter
    emulates a masked store by writing back what it read, so there that last row is a spare
    one (``SPARE_ROWS``) that no real row shares.
    """
    store_row = jnp.minimum(flat_row, o_ref.shape[0] - 1)[:, None]
    column = jnp.arange(o_ref.shape[-1], dtype=jnp.int32)[None, :]
    mask = jnp.broadcast_to(row_ok[:, None], values.shape)
    plgpu.store(o_ref.at[store_row, column], values.astype(o_ref.dtype), mask=mask)


def zero_padded_rows(
    o_ref, num_tokens, tile, head, row, *, group: int, q_heads: int, tokens: int,
    query_tile: int, zero_per_tile: int,
):  # fmt: skip
    """Zeros this program's rows of the padded tokens that tile ``tile`` answers for:
    ``zero_per_tile`` tokens from ``num_tokens + tile * zero_per_tile`` (the tiles together
    cover every padded token; real tokens are each in one tile, ``tiling`` checks that)."""
    query = lax.div(row, group)
    zeros = jnp.zeros((row.shape[0], o_ref.shape[-1]), jnp.float32)
    for chunk in range(pl.cdiv(zero_per_tile, query_tile)):
        offset = chunk * query_tile + query
        token = num_tokens + tile * zero_per_tile + offset
        row_ok = (query < query_tile) & (offset < zero_per_tile) & (token < tokens)
        flat_row = token * q_heads + head * group + lax.rem(row, group)
        store_rows(o_ref, flat_row, zeros, row_ok)


def zero_per_tile(token_capacity: int, num_tiles: int) -> int:
    """Padded tokens each tile's programs zero so that the tiles cover all of them."""
    return pl.cdiv(token_capacity, num_tiles)
