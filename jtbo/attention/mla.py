"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a latent paged KV pool.

MLA compresses each token's keys and values into one latent row ``c`` of ``kv_lora_rank``
values plus one RoPE key ``k_pe`` of ``qk_rope_head_dim`` values shared by every head. A head
``h`` reads its key as ``[c @ W_UK[h], k_pe]`` and its value as ``c @ W_UV[h]``, where
``W_UK`` / ``W_UV`` are the two halves of the up-projection ``kv_b [rank, heads, nope + v]``.
The pool therefore stores only ``[c, k_pe]`` per token: the ``KVCache``'s ``k`` holds it as
one KV head of ``rank + rope`` values, and its ``v`` has width 0.

Two exact ways to attend, chosen by the metadata's shape (``uses_absorbed``):

* **Decompressed** (EXTEND / MIXED): keys ``[nope + rope]`` and values ``[v]`` are
  up-projected per head and the queries ``[q_nope, q_pe]`` attend as in plain multi-head
  attention. When no sequence of the step has a prefix in the pool (a batch of fresh
  prompts; checked on the device), every key is one of the step's own latent rows: they are
  up-projected once, into a step-local cache the attention reads through a page table of
  their own (``step_rows_cache``). Otherwise every pool block the attention gathers is
  up-projected where it is read, once per (tile, block) pair: a block read by several tiles
  (a long prompt's prefix) is up-projected by each of them.
* **Absorbed** (DECODE / TARGET_VERIFY): ``q_nope . (c W_UK[h]) = (q_nope W_UK[h]^T) . c``,
  so the query is folded into latent space, ``[q_nope W_UK^T, q_pe]`` of width
  ``rank + rope``, and attends the latent rows directly as one shared key head; the softmax-
  weighted sum of latent rows is then projected by ``W_UV``. The kernel reads only the
  latent: ``rank + rope`` values per token instead of ``heads x (nope + rope + v)``.

The absorbed form's attention over the latent rows is ``paged.paged_attention(value_width=
kv_lora_rank)``: ``impl="xla"`` is the native attention with ``paged.latent_view``,
``impl="pallas"`` the paged kernel reading the latent rows straight from the pool, its values
being their first ``kv_lora_rank`` columns. The decompressed form over the step's own rows is
``paged.paged_attention`` of the same impl over ``step_rows_cache`` (keys of ``nope + rope``
and values of ``v`` columns per head); with prefixes it runs the native attention, which
up-projects each pool block as it gathers it.

Both forms compute the same scores and outputs; they differ only in float rounding. Heads
may be any subset (``attn_tp`` ranks pass their share of ``kv_b``); the latent is the same
on every rank.
"""

import jax
import jax.numpy as jnp

from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.attention import metadata as metadata_lib
from jtbo.attention import native, paged


def uses_absorbed(capacity: metadata_lib.AttentionCapacity) -> bool:
    """Whether steps of ``capacity`` attend in the absorbed form (decode and verify tiles)."""
    return capacity.query_tile == 1 or capacity.custom_mask


def decompressed_view(w_kv_b: jax.Array, qk_nope_head_dim: int) -> native.KVView:
    """Up-projects each gathered latent block to per-head keys and values.

    Args:
      w_kv_b: ``[kv_lora_rank, heads, qk_nope_head_dim + v_head_dim]`` up-projection.
      qk_nope_head_dim: key width without RoPE.

    Returns:
      A view giving keys ``[.., heads, nope + rope]`` and values ``[.., heads, v_head_dim]``.
    """
    rank, heads, width = w_kv_b.shape
    w_uk, w_uv = w_kv_b[..., :qk_nope_head_dim], w_kv_b[..., qk_nope_head_dim:]

    def expand(k_block, _):
        latent, k_pe = k_block[:, :, 0, :rank], k_block[:, :, 0, rank:]  # [tiles, block, ..]
        f32 = jnp.float32
        k_nope = jnp.einsum("tbr,rhn->tbhn", latent, w_uk, preferred_element_type=f32)
        values = jnp.einsum("tbr,rhv->tbhv", latent, w_uv, preferred_element_type=f32)
        k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (*k_pe.shape[:2], heads, k_pe.shape[-1]))
        keys = jnp.concatenate([k_nope.astype(k_block.dtype), k_pe], axis=-1)
        return keys, values.astype(k_block.dtype)

    return native.KVView(heads, width - qk_nope_head_dim, expand)


def has_no_prefix(md: metadata_lib.AttentionMetadata, num_reqs: int) -> jax.Array:
    """Whether no sequence of the step has tokens in the pool from earlier steps.

    Args:
      md: the step's metadata.
      num_reqs: rows of the page table.

    Returns:
      A boolean scalar (traced): every tile's prefix (``metadata.tile_prefix_lens``) is 0.
    """
    return jnp.all(metadata_lib.tile_prefix_lens(md, num_reqs) == 0)


def step_rows_cache(
    latent: jax.Array,
    view: native.KVView,
    md: metadata_lib.AttentionMetadata,
    cache: kv_cache_lib.KVCache,
) -> kv_cache_lib.KVCache:
    """A one-layer cache of the step's own rows, up-projected once (valid without prefixes).

    Slot ``1 + t`` holds token ``t``'s keys and values, up-projected by ``view`` as the pool
    blocks would be (slot 0: the padding slot); position ``p`` of a sequence maps to the slot
    of its ``p``-th new token, which is where the sequence's tokens lie when it has no prefix
    (``has_no_prefix``).

    Args:
      latent: ``[token_capacity, kv_lora_rank + qk_rope_head_dim]`` the step's latent rows.
      view: ``decompressed_view`` of the layer's up-projection.
      md: the step's metadata.
      cache: the latent cache (its dtype and page-table shape are kept).

    Returns:
      ``KVCache`` with ``k [1, token_capacity + 1, heads, nope + rope]``, ``v [1, ..,
      heads, v]`` and a page table of ``cache.req_to_token``'s shape.
    """
    tokens = latent.shape[0]
    rows = latent.astype(cache.k.dtype)[None, :, None, :]  # one block of every row
    keys, values = view.expand(rows, None)  # [1, tokens, heads, ..]
    pad = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)  # noqa: E731
    reqs, width = cache.req_to_token.shape
    valid = md.tile_q_len > 0
    first_token = jax.ops.segment_min(
        jnp.where(valid, md.tile_q_start - md.tile_q_pos, tokens).astype(jnp.int32),
        md.tile_req, reqs,
    )  # fmt: skip
    table = jnp.clip(first_token[:, None] + jnp.arange(width)[None, :] + 1, 0, tokens)
    return kv_cache_lib.KVCache(k=pad(keys), v=pad(values), req_to_token=table.astype(jnp.int32))


def write_latent(
    latent: jax.Array,
    layer_id: int | jax.Array,
    md: metadata_lib.AttentionMetadata,
    cache: kv_cache_lib.KVCache,
) -> kv_cache_lib.KVCache:
    """Stores the step's latent rows at ``out_cache_loc`` (padded rows are dropped).

    Args:
      latent: ``[token_capacity, kv_lora_rank + qk_rope_head_dim]`` (RoPE already applied).
      layer_id: layer index.
      md: the step's metadata.
      cache: the latent cache (``k [L, slots, 1, rank + rope]``, no ``v``).

    Returns:
      The cache holding the step's latent rows.

    Raises:
      ValueError: the cache is not a latent cache of this width, or token counts disagree.
    """
    expected = (1, latent.shape[-1])
    if cache.k.shape[2:] != expected or cache.v is not None:
        raise ValueError(
            f"MLA needs a latent cache with k [.., 1, {latent.shape[-1]}] and no v; "
            f"found k {cache.k.shape}, v {None if cache.v is None else cache.v.shape}"
        )
    rows = latent[:, None, :]
    return native.write_step_kv(rows, rows, None, layer_id, md, cache)


def forward(
    q_nope: jax.Array,
    q_pe: jax.Array,
    latent: jax.Array,
    w_kv_b: jax.Array,
    layer_id: int | jax.Array,
    md: metadata_lib.AttentionMetadata,
    cache: kv_cache_lib.KVCache,
    *,
    scaling: float,
    absorbed: bool,
    config: native.NativeAttentionConfig = native.DEFAULT_CONFIG,
    impl: str | None = None,
    kernel_config: paged.PagedAttentionConfig = paged.DEFAULT_CONFIG,
) -> tuple[jax.Array, kv_cache_lib.KVCache]:
    """Writes the step's latent rows and attends (see the module docstring).

    Args:
      q_nope: ``[token_capacity, heads, qk_nope_head_dim]`` queries without RoPE.
      q_pe: ``[token_capacity, heads, qk_rope_head_dim]`` RoPE'd queries.
      latent: ``[token_capacity, kv_lora_rank + qk_rope_head_dim]``: normed latent, RoPE'd key.
      w_kv_b: ``[kv_lora_rank, heads, qk_nope_head_dim + v_head_dim]`` (this rank's heads).
      layer_id: layer index.
      md: the step's metadata.
      cache: the latent cache (donate it to update in place).
      scaling: softmax scale (``(nope + rope) ** -0.5`` times any YaRN mscale).
      absorbed: attend in the absorbed form (True) or the decompressed one.
      config: native kernel knobs.
      impl: the ``paged.paged_attention`` impl of the absorbed form and of the decompressed
        form over the step's own rows (the decompressed form with prefixes is native only).
      kernel_config: the paged kernel's launch shape (``impl="pallas"``).

    Returns:
      ``(out [token_capacity, heads, v_head_dim] in q_nope.dtype, new cache)``.

    Raises:
      ValueError: as ``write_latent``.
    """
    cache = write_latent(latent, layer_id, md, cache)
    kernels = dict(scaling=scaling, impl=impl, config=config, kernel_config=kernel_config)
    if not absorbed:
        return _decompressed(q_nope, q_pe, latent, w_kv_b, layer_id, md, cache, **kernels), cache
    return _absorbed(q_nope, q_pe, w_kv_b, layer_id, md, cache, **kernels), cache


def _decompressed(q_nope, q_pe, latent, w_kv_b, layer_id, md, cache, *, scaling, impl, config,
                  kernel_config):  # fmt: skip
    """``forward``'s decompressed form over the written cache: ``[T, heads, v_head_dim]``."""
    q = jnp.concatenate([q_nope, q_pe.astype(q_nope.dtype)], axis=-1)
    view = decompressed_view(w_kv_b.astype(cache.k.dtype), q_nope.shape[-1])

    def step_rows():  # no prefix: the step's own rows, up-projected once
        rows = step_rows_cache(latent, view, md, cache)
        return paged.paged_attention(
            q, rows, 0, md, scaling=scaling, impl=impl, config=kernel_config,
            native_config=config,
        )  # fmt: skip

    def pool_blocks():  # up-projected per gathered pool block
        return native.attend(q, cache, layer_id, md, scaling=scaling, config=config, view=view)

    no_prefix = has_no_prefix(md, cache.req_to_token.shape[0])
    return jax.lax.cond(no_prefix, step_rows, pool_blocks)


def _absorbed(q_nope, q_pe, w_kv_b, layer_id, md, cache, *, scaling, impl, config,
              kernel_config):  # fmt: skip
    """``forward``'s absorbed form over the written cache: ``[T, heads, v_head_dim]``."""
    nope = q_nope.shape[-1]
    w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]
    f32 = jnp.float32
    q_latent = jnp.einsum("thn,rhn->thr", q_nope, w_uk, preferred_element_type=f32)
    q = jnp.concatenate([q_latent, q_pe.astype(f32)], axis=-1).astype(q_nope.dtype)
    out_latent = paged.paged_attention(
        q, cache, layer_id, md, scaling=scaling, impl=impl, config=kernel_config,
        native_config=config, value_width=w_kv_b.shape[0],
    )  # fmt: skip  # [T, heads, rank]
    out = jnp.einsum("thr,rhv->thv", out_latent, w_uv, preferred_element_type=f32)
    return out.astype(q_nope.dtype)
