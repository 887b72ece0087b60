"""Dense reference of the paged attention: every tile against all ``max_context`` positions.

Same inputs and masking rules as ``native.attend``, but with a plain softmax over the whole
page-table row at once (``tiles x rows x heads x max_context`` scores). Small shapes only: it
exists to check the blocked kernel, not to run models.
"""

import jax
import jax.numpy as jnp

from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.attention import metadata as metadata_lib


def attend_reference(
    q: jax.Array,
    cache: kv_cache_lib.KVCache,
    layer_id: int | jax.Array,
    md: metadata_lib.AttentionMetadata,
    *,
    scaling: float,
) -> jax.Array:
    """Dense counterpart of ``native.attend`` (float32 softmax over all positions).

    Args:
      q: queries, ``[token_capacity, q_heads, head_dim]``.
      cache: the KV cache holding the step's new tokens.
      layer_id: layer whose pool is read.
      md: the step's metadata.
      scaling: factor applied to ``q . k``.

    Returns:
      ``[token_capacity, q_heads, v_head_dim]``; zeros for rows without keys or past
      ``md.num_tokens``.
    """
    rows = jnp.arange(md.capacity.query_tile)
    pos = jnp.arange(cache.max_context)
    row_valid = rows[None, :] < md.tile_q_len[:, None]
    token = jnp.where(row_valid, md.tile_q_start[:, None] + rows[None, :], 0)
    slots = cache.req_to_token[md.tile_req]  # [tiles, max_context]
    k = cache.k[layer_id, slots].astype(jnp.float32)  # [tiles, ctx, kvh, d]
    v = cache.v[layer_id, slots].astype(jnp.float32)
    q_t = q[token].astype(jnp.float32)  # [tiles, rows, qh, d]
    group = q.shape[1] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("tqhd,tkhd->thqk", q_t, k) * scaling
    visible = (pos[None, None, :] < md.tile_kv_len[:, None, None]) & row_valid[:, :, None]
    if md.custom_mask is not None:
        visible = visible & md.custom_mask
    else:
        visible = visible & (pos[None, None, :] <= (md.tile_q_pos[:, None] + rows)[:, :, None])
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
    weights = jnp.nan_to_num(jax.nn.softmax(scores, axis=-1))  # all-masked rows -> 0
    out = jnp.einsum("thqk,tkhd->tqhd", weights, v).astype(q.dtype)
    keep = row_valid & (token < md.num_tokens)
    target = jnp.where(keep, token, q.shape[0]).reshape(-1)
    flat = jnp.zeros((q.shape[0], q.shape[1], v.shape[-1]), q.dtype)
    return flat.at[target].set(out.reshape(-1, *out.shape[2:]), mode="drop")
