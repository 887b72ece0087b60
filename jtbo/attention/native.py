"""Native (pure jnp) paged attention: query tiles x KV blocks with an online softmax.

For every query tile (``query_tile`` tokens of one sequence, see ``metadata``) the kernel walks
the sequence's KV positions in blocks of ``kv_block`` (``decode_kv_block`` for one-row decode
tiles, where a long block costs little and every loop step a fixed overhead): it looks the
block's pool slots up in ``req_to_token``, gathers their K/V from the layer's pool, scores
the tile against them and folds the block into running (max, sum, weighted-value)
accumulators in float32 — the flash-attention recurrence, so nothing of size
``tokens x max_context x heads`` ever exists.
Tiles advance together in *chunks* of about ``chunk_rows`` query rows (a batch dimension),
and only chunks up to the step's last real tile run (a traced trip count): the metadata is
sized for the worst case a static capacity can hold (e.g. every sequence of the step's
sequence bound one token long), so most of its tiles are usually empty, and a TBO child
holds as many tiles as the worst case of either child; processing all of them was the bulk
of both steps' attention (docs/benchmarks/, "TBO step cost on one GPU").
Within a chunk the block loop runs only up to the chunk's furthest visible KV position
(causal: the last query's position; custom mask: ``tile_kv_len``), so short steps and the
early tiles of a causal prompt do not pay for ``max_context``. A skipped block is fully masked
for every row, which leaves the online-softmax accumulators exactly unchanged, so the result
does not depend on the chunking.

Masking, per (query row ``r`` of tile ``t``, KV position ``j``):
* ``j < tile_kv_len[t]`` and row ``r < tile_q_len[t]`` always;
* causal capacities: ``j <= tile_q_pos[t] + r`` (EXTEND/MIXED over prefix + new tokens, DECODE);
* custom-mask capacities: the EAGLE bit ``custom_mask[t, r, j]`` (TARGET_VERIFY).

GQA is handled by grouping ``q_heads // kv_heads`` query heads per KV head. Rows with no
visible key, and rows past ``num_tokens``, come out as zeros.

A ``KVView`` turns each gathered pool block into the keys and values the scores use (MLA,
``jtbo.attention.mla``: the latent read as one shared key head, or up-projected to per-head
K/V); without one the pool's K/V are used as stored.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.attention import metadata as metadata_lib
from jtbo.core import arith


@dataclasses.dataclass(frozen=True)
class NativeAttentionConfig:
    """Tuning knobs of the native kernel.

    Attributes:
      kv_block: KV positions processed per loop step; bounds the working set to
        ``chunk tiles x kv_block x kv_heads x head_dim`` gathered K/V plus the score block.
      chunk_rows: query rows per chunk of tiles (``chunk_rows // query_tile`` tiles, at
        least 1, at most all); only chunks holding real tiles run.
      decode_kv_block: KV positions per loop step when tiles hold one query row (decode).
        A decode tile is one row, so a block costs ``rows x block`` scores where a prefill
        tile's costs ``query_tile`` times more; every loop step, on the other hand, costs
        its kernels (10 on XLA:GPU) plus a device-to-host read of the loop condition whatever
        its size. At decode, small blocks make many loop steps per layer, whose kernels are
        most of the step's, and a TBO step runs two such loops per layer. The
        block depends on the capacity only, so TBO children and the plain step, and every
        chunking, fold the same blocks: the same numbers.
    """

    kv_block: int = 128
    chunk_rows: int = 1024
    decode_kv_block: int = 1024

    def __post_init__(self):
        if self.kv_block < 1:
            raise ValueError(f"NativeAttentionConfig.kv_block must be >= 1, got {self.kv_block}")
        if self.decode_kv_block < 1:
            raise ValueError(
                f"NativeAttentionConfig.decode_kv_block must be >= 1, got {self.decode_kv_block}"
            )
        if self.chunk_rows < 1:
            raise ValueError(
                f"NativeAttentionConfig.chunk_rows must be >= 1, got {self.chunk_rows}"
            )


DEFAULT_CONFIG = NativeAttentionConfig()
"""The kernel knobs used when none are given."""


@dataclasses.dataclass(frozen=True)
class KVView:
    """How the kernel reads a pool block as keys and values.

    Attributes:
      kv_heads: key/value heads after ``expand`` (query heads are grouped over them).
      v_head_dim: value width after ``expand`` (the output width).
      expand: ``(k_block [tiles, block, pool_heads, dk], v_block [..., dv]) ->
        (keys [tiles, block, kv_heads, dq], values [tiles, block, kv_heads, v_head_dim])``.
    """

    kv_heads: int
    v_head_dim: int
    expand: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def block_size(config: NativeAttentionConfig, capacity: metadata_lib.AttentionCapacity) -> int:
    """KV positions per loop step for ``capacity``'s tiles (see the config).

    One-row (decode) tiles take ``decode_kv_block``, at most ``max_context`` (no longer
    than any sequence can be); other tiles ``kv_block``.
    """
    if capacity.query_tile == 1:
        return min(config.decode_kv_block, capacity.max_context)
    return config.kv_block


def _tile_queries(q: jax.Array, md: metadata_lib.AttentionMetadata, kv_heads: int):
    """Gathers the queries of every tile: ``[tiles, rows, kv_heads, group, d]`` and row masks."""
    rows = jnp.arange(md.capacity.query_tile)
    row_valid = rows[None, :] < md.tile_q_len[:, None]  # [tiles, rows]
    token = jnp.where(row_valid, md.tile_q_start[:, None] + rows[None, :], 0)
    q_tiles = q[token]  # [tiles, rows, q_heads, d]
    group = q.shape[1] // kv_heads
    return q_tiles.reshape(*q_tiles.shape[:2], kv_heads, group, q.shape[2]), token, row_valid


def _block_mask(md: metadata_lib.AttentionMetadata, pos: jax.Array, row_valid: jax.Array):
    """Returns which (tile, row, key) pairs of a KV block are visible: ``[tiles, rows, block]``."""
    visible = (pos[None, None, :] < md.tile_kv_len[:, None, None]) & row_valid[:, :, None]
    if md.custom_mask is not None:
        column = jnp.minimum(pos, md.capacity.max_context - 1)
        return visible & jnp.take(md.custom_mask, column, axis=2)
    rows = jnp.arange(md.capacity.query_tile)
    q_pos = md.tile_q_pos[:, None] + rows[None, :]  # [tiles, rows]
    return visible & (pos[None, None, :] <= q_pos[:, :, None])


def _gather_block(cache: kv_cache_lib.KVCache, layer_id, md, pos: jax.Array):
    """Gathers K/V of one block for every tile: ``[tiles, block, kv_heads, d]`` each (V None
    for a cache without a value pool: MLA's views derive values from the keys)."""
    column = jnp.minimum(pos, cache.max_context - 1)
    slots = cache.req_to_token[md.tile_req[:, None], column[None, :]]  # [tiles, block]
    # Positions past a sequence's end may hold stale slots; read the padding slot instead.
    slots = jnp.where(pos[None, :] < md.tile_kv_len[:, None], slots, kv_cache_lib.PADDING_SLOT)
    return cache.k[layer_id, slots], None if cache.v is None else cache.v[layer_id, slots]


def _online_softmax_step(carry, scores, v_block):
    """Folds one block of masked scores into the (max, sum, acc) accumulators."""
    m, denom, acc = carry
    m_new = jnp.maximum(m, scores.max(axis=-1))
    # A row that has seen no visible key keeps max -inf; shift it by 0 to avoid inf - inf.
    m_shift = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(scores - m_shift[..., None])  # [tiles, kvh, group, rows, block]
    correction = jnp.exp(m - m_shift)
    denom = denom * correction + p.sum(axis=-1)
    pv = jnp.einsum(
        "thgqk,tkhd->thgqd", p.astype(v_block.dtype), v_block, preferred_element_type=jnp.float32
    )
    return m_new, denom, acc * correction[..., None] + pv


def attend(
    q: jax.Array,
    cache: kv_cache_lib.KVCache,
    layer_id: int | jax.Array,
    md: metadata_lib.AttentionMetadata,
    *,
    scaling: float,
    config: NativeAttentionConfig = DEFAULT_CONFIG,
    view: KVView | None = None,
) -> jax.Array:
    """Attends every tile's queries over its sequence's cached K/V (already written).

    Args:
      q: queries, ``[token_capacity, q_heads, head_dim]``.
      cache: the KV cache, holding this step's new tokens already.
      layer_id: layer whose pool is read.
      md: the step's metadata.
      scaling: factor applied to ``q . k``.
      config: kernel knobs.
      view: how pool blocks become keys and values; None: as stored.

    Returns:
      ``[token_capacity, q_heads, v_head_dim]`` in ``q.dtype``; zeros for rows without keys
      and rows past ``md.num_tokens``.

    Raises:
      ValueError: no ``view`` for a cache without a value pool.
    """
    if view is None:
        if cache.v is None:
            raise ValueError("a cache without a value pool (MLA) needs a view of its keys")
        view = KVView(cache.k.shape[2], cache.v.shape[-1], lambda k, v: (k, v))
    num_tiles = md.capacity.num_tiles
    chunk = min(num_tiles, max(1, config.chunk_rows // md.capacity.query_tile))
    out = jnp.zeros((q.shape[0], q.shape[1], view.v_head_dim), q.dtype)
    attend_chunk = functools.partial(_attend_chunk, scaling=scaling, config=config, view=view)
    if chunk == num_tiles:
        return attend_chunk(q, cache, layer_id, md, out)

    def body(c, out):
        # The last chunk is shifted back to stay in bounds; tiles it repeats write the same
        # rows with the same values.
        start = jnp.minimum(c * chunk, num_tiles - chunk)
        sub = _tile_slice(md, start, chunk)
        return attend_chunk(q, cache, layer_id, sub, out)

    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    real_end = jnp.max(jnp.where(md.tile_q_len > 0, tile_ids + 1, 0))
    return lax.fori_loop(0, arith.ceil_div(real_end, chunk), body, out)


def _tile_slice(md: metadata_lib.AttentionMetadata, start, size: int):
    """Tiles ``[start, start + size)`` of ``md`` (token-level fields unchanged)."""
    capacity = dataclasses.replace(md.capacity, num_tiles=size)

    def cut(x):
        return lax.dynamic_slice_in_dim(x, start, size, axis=0)

    mask = None if md.custom_mask is None else cut(md.custom_mask)
    return dataclasses.replace(
        md,
        tile_req=cut(md.tile_req),
        tile_q_start=cut(md.tile_q_start),
        tile_q_len=cut(md.tile_q_len),
        tile_q_pos=cut(md.tile_q_pos),
        tile_kv_len=cut(md.tile_kv_len),
        custom_mask=mask,
        capacity=capacity,
    )


def _visible_end(md: metadata_lib.AttentionMetadata) -> jax.Array:
    """One past the furthest KV position any real row of ``md``'s tiles may see."""
    end = md.tile_kv_len
    if md.custom_mask is None:  # causal: no row sees past its own position
        end = jnp.minimum(end, md.tile_q_pos + md.tile_q_len)
    return jnp.max(jnp.where(md.tile_q_len > 0, end, 0))


def _attend_chunk(q, cache, layer_id, md, out, *, scaling, config, view) -> jax.Array:
    """Attends the tiles of ``md`` and writes their rows into ``out``."""
    q_tiles, token, row_valid = _tile_queries(q, md, view.kv_heads)
    block = block_size(config, md.capacity)

    def body(b, carry):
        pos = b * block + jnp.arange(block)
        k_block, v_block = view.expand(*_gather_block(cache, layer_id, md, pos))
        scores = jnp.einsum(
            "tqhgd,tkhd->thgqk", q_tiles, k_block.astype(q.dtype),
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        visible = _block_mask(md, pos, row_valid)  # [tiles, rows, block]
        scores = jnp.where(visible[:, None, None, :, :], scores * scaling, -jnp.inf)
        return _online_softmax_step(carry, scores, v_block)

    init = _initial_carry(q_tiles.shape, view.v_head_dim)
    trips = arith.ceil_div(_visible_end(md), block)
    _, denom, acc = lax.fori_loop(0, trips, body, init)
    tile_out = _normalise(denom, acc).astype(q.dtype)
    return _scatter_rows(out, tile_out, token, row_valid, md.num_tokens)


def _initial_carry(q_tiles_shape, dv: int):
    """Running max (-inf), denominator and weighted values of the online softmax."""
    tiles, rows, kv_heads, group, _ = q_tiles_shape
    stats = (tiles, kv_heads, group, rows)
    return (
        jnp.full(stats, -jnp.inf, jnp.float32),
        jnp.zeros(stats, jnp.float32),
        jnp.zeros((*stats, dv), jnp.float32),
    )


def _normalise(denom, acc) -> jax.Array:
    """Divides by the softmax denominator (rows that saw no key stay 0): [tiles, rows, qh, dv]."""
    out = jnp.where(denom[..., None] > 0, acc / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
    tiles, kv_heads, group, rows, dv = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(tiles, rows, kv_heads * group, dv)


def _scatter_rows(out, tile_out, token, row_valid, num_tokens) -> jax.Array:
    """Writes tile rows into their flat token rows of ``out``; other rows keep their value."""
    keep = row_valid & (token < num_tokens)
    target = jnp.where(keep, token, out.shape[0])  # out of range: dropped
    return out.at[target.reshape(-1)].set(
        tile_out.reshape(-1, *tile_out.shape[2:]), mode="drop", unique_indices=True
    )


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer_id: int | jax.Array,
    md: metadata_lib.AttentionMetadata,
    cache: kv_cache_lib.KVCache,
    *,
    scaling: float | None = None,
    config: NativeAttentionConfig = DEFAULT_CONFIG,
) -> tuple[jax.Array, kv_cache_lib.KVCache]:
    """Writes the step's K/V at ``out_cache_loc`` and attends (see the module docstring).

    Args:
      q: queries, ``[token_capacity, q_heads, head_dim]``.
      k: new keys, ``[token_capacity, kv_heads, head_dim]``.
      v: new values, ``[token_capacity, kv_heads, v_head_dim]``.
      layer_id: layer index.
      md: the step's metadata.
      cache: the KV cache (donate it to update in place).
      scaling: score scale; ``head_dim ** -0.5`` when None.
      config: kernel knobs.

    Returns:
      ``(out [token_capacity, q_heads, v_head_dim], new cache)``.

    Raises:
      ValueError: token counts disagree with the capacity, or q heads are not a multiple of
        the KV heads.
    """
    cache = write_step_kv(q, k, v, layer_id, md, cache)
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    return attend(q, cache, layer_id, md, scaling=scaling, config=config), cache


def write_step_kv(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array | None,
    layer_id: int | jax.Array,
    md: metadata_lib.AttentionMetadata,
    cache: kv_cache_lib.KVCache,
) -> kv_cache_lib.KVCache:
    """Checks the step's shapes and writes its real tokens' K/V at ``out_cache_loc``.

    Padded rows (at or past ``md.num_tokens``) target the padding slot and are dropped.
    Every attention impl writes this way before it attends.

    Args:
      q: queries, ``[token_capacity, q_heads, head_dim]`` (shape-checked only).
      k: new keys, ``[token_capacity, kv_heads, head_dim]``.
      v: new values, ``[token_capacity, kv_heads, v_head_dim]``; None for a cache without a
        value pool (MLA's latent pool).
      layer_id: layer index.
      md: the step's metadata.
      cache: the KV cache.

    Returns:
      The cache holding the step's K/V.

    Raises:
      ValueError: as ``forward``.
    """
    check_step_shapes(q, k, cache, md)
    valid = jnp.arange(q.shape[0]) < md.num_tokens
    loc = jnp.where(valid, md.out_cache_loc, kv_cache_lib.PADDING_SLOT)
    return kv_cache_lib.write_kv(cache, layer_id, loc, k, v)


def check_step_shapes(q, k, cache, md) -> None:
    """Raises ValueError when q/k do not fit the metadata's capacity or the cache."""
    capacity = md.capacity.token_capacity
    if q.shape[0] != capacity or k.shape[0] != capacity:
        raise ValueError(
            f"q has {q.shape[0]} and k {k.shape[0]} tokens; token_capacity is {capacity}"
        )
    if q.shape[1] % cache.k.shape[2]:
        raise ValueError(
            f"q_heads = {q.shape[1]} is not a multiple of kv_heads = {cache.k.shape[2]}"
        )
    if cache.max_context != md.capacity.max_context:
        raise ValueError(
            f"cache max_context = {cache.max_context}, metadata max_context = "
            f"{md.capacity.max_context}"
        )
