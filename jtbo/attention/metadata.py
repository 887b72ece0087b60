"""Attention metadata of one DP rank: query tiles over a paged KV cache, at static capacities.

The native backend processes the step's query tokens in *tiles*: ``query_tile`` consecutive
tokens of one sequence. Every sequence of the batch is cut into ``ceil(len / query_tile)``
tiles, so a tile never straddles two sequences, and each tile knows

* where its queries start in the flat token array (``tile_q_start``) and how many are real
  (``tile_q_len``; 0 for unused tiles),
* the request row of the page table it reads (``tile_req``),
* the KV position of its first query (``tile_q_pos``; query ``r`` sits at ``tile_q_pos + r``)
  and how many KV positions its sequence exposes (``tile_kv_len``).

That single description covers every forward mode (SGLang's metadata for extend, decode and
target-verify, flattened): EXTEND/MIXED tiles have ``tile_q_pos = prefix + offset`` and
``tile_kv_len = seq_len``; DECODE is one-token tiles at ``seq_len - 1``; TARGET_VERIFY is one
tile of ``draft_token_num`` rows per sequence with ``tile_kv_len = seq_len + draft_token_num``
and the EAGLE custom mask (per tile ``[query_tile, max_context]`` booleans) instead of the
causal rule. Shapes depend only on the static ``AttentionCapacity``, so metadata of several DP
ranks stacks with ``jax.tree.map(np.stack, ...)`` and a jitted step traces once per capacity.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class AttentionCapacity:
    """Static sizes of one DP rank's attention metadata (one compile per distinct value).

    Attributes:
      token_capacity: query tokens the step's buffers hold (padded rows included).
      seq_capacity: sequences the step may hold.
      query_tile: query tokens per tile (1 for decode, ``draft_token_num`` for verify).
      num_tiles: tiles the metadata holds; a batch needing more is rejected.
      max_context: KV positions a sequence may expose (the page table's width).
      custom_mask: whether tiles carry the EAGLE custom mask (TARGET_VERIFY) instead of the
        causal rule.
    """

    token_capacity: int
    seq_capacity: int
    query_tile: int
    num_tiles: int
    max_context: int
    custom_mask: bool = False

    def __post_init__(self):
        for name in ("token_capacity", "seq_capacity", "query_tile", "num_tiles", "max_context"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"AttentionCapacity.{name} must be >= 1, got {getattr(self, name)}"
                )


def extend_capacity(
    token_capacity: int, seq_capacity: int, max_context: int, query_tile: int = 64
) -> AttentionCapacity:
    """Returns a capacity for EXTEND/MIXED batches: enough tiles for any ragged split.

    ``n`` non-empty sequences of total length ``T`` need at most ``n + (T - n) // query_tile``
    tiles, which grows with ``n``; the bound takes ``n = min(seq_capacity, token_capacity)``.

    Args:
      token_capacity: query tokens per step.
      seq_capacity: sequences per step.
      max_context: the page table's width.
      query_tile: query tokens per tile.

    Returns:
      An ``AttentionCapacity`` with the causal rule.
    """
    n = min(seq_capacity, token_capacity)
    return AttentionCapacity(
        token_capacity=token_capacity,
        seq_capacity=seq_capacity,
        query_tile=query_tile,
        num_tiles=n + (token_capacity - n) // query_tile,
        max_context=max_context,
    )


def decode_capacity(seq_capacity: int, max_context: int) -> AttentionCapacity:
    """Returns a capacity for DECODE batches: one token and one single-row tile per sequence.

    Args:
      seq_capacity: sequences per step.
      max_context: the page table's width.

    Returns:
      An ``AttentionCapacity`` with the causal rule.
    """
    return AttentionCapacity(
        token_capacity=seq_capacity,
        seq_capacity=seq_capacity,
        query_tile=1,
        num_tiles=seq_capacity,
        max_context=max_context,
    )


def verify_capacity(seq_capacity: int, draft_token_num: int, max_context: int) -> AttentionCapacity:
    """Returns a capacity for TARGET_VERIFY: one tile of ``draft_token_num`` rows per sequence.

    Args:
      seq_capacity: sequences per step.
      draft_token_num: draft tokens verified per sequence.
      max_context: the page table's width.

    Returns:
      An ``AttentionCapacity`` with the custom mask.
    """
    return AttentionCapacity(
        token_capacity=seq_capacity * draft_token_num,
        seq_capacity=seq_capacity,
        query_tile=draft_token_num,
        num_tiles=seq_capacity,
        max_context=max_context,
        custom_mask=True,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Query tiles of one DP rank's step (see the module docstring).

    Attributes:
      tile_req: page-table row read by each tile.
      tile_q_start: flat index of each tile's first query token.
      tile_q_len: real queries in each tile (0: unused tile).
      tile_q_pos: KV position of each tile's first query.
      tile_kv_len: KV positions visible to each tile's sequence.
      out_cache_loc: pool slot each token's new K/V is written to (0 for padding).
      num_tokens: real query tokens; rows at or past it produce zeros.
      custom_mask: EAGLE mask per tile row and KV position (None unless
        ``capacity.custom_mask``).
      capacity: the static sizes.
    """

    tile_req: jax.Array  # [num_tiles] int32
    tile_q_start: jax.Array  # [num_tiles] int32
    tile_q_len: jax.Array  # [num_tiles] int32
    tile_q_pos: jax.Array  # [num_tiles] int32
    tile_kv_len: jax.Array  # [num_tiles] int32
    out_cache_loc: jax.Array  # [token_capacity] int32
    num_tokens: jax.Array  # [] int32
    custom_mask: jax.Array | None  # [num_tiles, query_tile, max_context] bool
    capacity: AttentionCapacity = dataclasses.field(metadata=dict(static=True))


def tile_prefix_lens(md: AttentionMetadata, num_reqs: int) -> jax.Array:
    """Per tile, its sequence's prefix: the KV positions cached before this step (traced).

    A sequence's tiles share a page-table row, and its first tile starts at its prefix length,
    so the prefix is the smallest ``tile_q_pos`` of the row's real tiles.

    Args:
      md: the step's metadata (one sequence per page-table row).
      num_reqs: rows of the page table.

    Returns:
      ``[num_tiles]`` int32; 0 for unused tiles.
    """
    valid = md.tile_q_len > 0
    never = jnp.iinfo(jnp.int32).max
    first_pos = jax.ops.segment_min(
        jnp.where(valid, md.tile_q_pos, never).astype(jnp.int32), md.tile_req, num_reqs
    )
    return jnp.where(valid, first_pos[md.tile_req], 0).astype(jnp.int32)


def empty_metadata(capacity: AttentionCapacity) -> AttentionMetadata:
    """Returns metadata with no tiles and no tokens (an IDLE rank or an empty TBO child).

    Args:
      capacity: the static sizes.

    Returns:
      Numpy-backed ``AttentionMetadata`` whose forward writes nothing real and returns zeros.
    """
    zeros_tiles = np.zeros((capacity.num_tiles,), np.int32)
    mask = None
    if capacity.custom_mask:
        mask = np.zeros((capacity.num_tiles, capacity.query_tile, capacity.max_context), bool)
    return AttentionMetadata(
        tile_req=zeros_tiles,
        tile_q_start=zeros_tiles.copy(),
        tile_q_len=zeros_tiles.copy(),
        tile_q_pos=zeros_tiles.copy(),
        tile_kv_len=zeros_tiles.copy(),
        out_cache_loc=np.zeros((capacity.token_capacity,), np.int32),
        num_tokens=np.zeros((), np.int32),
        custom_mask=mask,
        capacity=capacity,
    )
