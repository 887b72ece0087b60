"""Paged KV cache of one DP rank: a token-indexed K/V pool per layer plus a request page table.

Layout (the contract the model and runner code against):

* ``k`` and ``v`` are ``[num_layers, num_slots, kv_heads, head_dim]`` arrays, one stacked
  array each rather than a tuple per layer, so that a layer loop written with ``lax.scan`` or
  a Python loop indexes them the same way and the runner donates two buffers, not 2 x layers.
  ``v`` may have its own head dim (``v_head_dim``). An MLA model (``jtbo.attention.mla``)
  keeps one latent row per token in ``k`` (``[.., slots, 1, kv_lora_rank + qk_rope_head_dim]``
  on each rank) and no ``v`` (None): its values are the latent's first columns.
* ``req_to_token`` is ``[max_reqs, max_context]`` int32: row ``r`` lists, position by
  position, the pool slot that holds request ``r``'s token. The scheduler fills it for every
  token of the step *before* the forward (the prefix, the new extend tokens and, for
  target-verify, the draft tokens), exactly like SGLang's ``req_to_token_pool``.
* Slot 0 is reserved as the padding slot: padded tokens carry ``out_cache_loc = 0``, and
  their writes are dropped; real tokens never live in slot 0, and no two real tokens of a
  write share a slot. Reads past a sequence point at the padding slot and are masked.

``ModelRunner`` allocates every DP rank's cache at once: the pools stacked along a leading
``dp`` axis and sharded over the mesh, the page table on the host.

Writes are functional (``.at[].set``); under ``jit`` with the cache donated XLA updates the
pool in place, so a step does not copy it. A write's destinations are distinct (each padded
token is sent to its own slot past the pool and dropped), so XLA knows the indices are unique
and scatters without atomics, which it must use when padded tokens share a slot
(docs/benchmarks/, "Attention: the extend kernel", the K/V write).
"""

import dataclasses

import jax
import jax.numpy as jnp

PADDING_SLOT = 0
"""Pool slot of padded tokens (their writes are dropped); never holds a real token."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """K/V pools of every layer and the request-to-slot page table of one DP rank.

    Attributes:
      k: keys, ``[num_layers, num_slots, kv_heads, head_dim]``.
      v: values, ``[num_layers, num_slots, kv_heads, v_head_dim]``; None for an MLA latent
        pool, whose values are the first columns of ``k``.
      req_to_token: pool slot of each (request, position), ``[max_reqs, max_context]`` int32.
    """

    k: jax.Array  # [num_layers, num_slots, kv_heads, head_dim]
    v: jax.Array | None  # [num_layers, num_slots, kv_heads, v_head_dim]; None: MLA
    req_to_token: jax.Array  # [max_reqs, max_context]

    @property
    def num_layers(self) -> int:
        """Number of layers in the pool."""
        return self.k.shape[0]

    @property
    def num_slots(self) -> int:
        """Token slots per layer, the padding slot included."""
        return self.k.shape[1]

    @property
    def max_context(self) -> int:
        """Longest sequence (in tokens) a request may hold."""
        return self.req_to_token.shape[1]


def write_kv(
    cache: KVCache, layer_id: int | jax.Array, loc: jax.Array, k: jax.Array, v: jax.Array | None
) -> KVCache:
    """Returns ``cache`` with ``k``/``v`` stored at pool slots ``loc`` of layer ``layer_id``.

    Args:
      cache: the cache to update.
      layer_id: layer index (static int or traced scalar).
      loc: destination slot of each token, ``[num_tokens]`` int32, distinct for real tokens;
        padded tokens use ``PADDING_SLOT`` and are not written.
      k: keys, ``[num_tokens, kv_heads, head_dim]``.
      v: values, ``[num_tokens, kv_heads, v_head_dim]``; None exactly when the cache has no
        value pool (MLA).

    Returns:
      The updated cache (``req_to_token`` unchanged).

    Raises:
      ValueError: ``k``/``v`` do not match the pool's head shape or ``loc``'s length, or ``v``
        is given to a cache without a value pool or missing for one with it.
    """
    if (v is None) != (cache.v is None):
        raise ValueError(
            f"values {'missing' if v is None else 'given'} for a cache "
            f"{'with' if cache.v is not None else 'without'} a value pool"
        )
    for name, new, pool in (("k", k, cache.k), ("v", v, cache.v)):
        if new is None:
            continue
        if new.shape != (loc.shape[0], *pool.shape[2:]):
            raise ValueError(
                f"{name} has shape {new.shape}, expected {(loc.shape[0], *pool.shape[2:])} "
                f"(num_tokens from out_cache_loc, heads/dim from the pool)"
            )
    # Each padded token gets its own slot past the pool: every destination is distinct, and
    # mode="drop" skips the padded ones.
    beyond = cache.num_slots + jnp.arange(loc.shape[0], dtype=loc.dtype)
    loc = jnp.where(loc == PADDING_SLOT, beyond, loc)

    def store(pool, new):
        return pool.at[layer_id, loc].set(new.astype(pool.dtype), mode="drop", unique_indices=True)

    return dataclasses.replace(
        cache, k=store(cache.k, k), v=None if v is None else store(cache.v, v)
    )
