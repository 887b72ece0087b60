"""Choosing the next token on the device, inside a jitted step: greedy, or temperature + top-p.

Every function takes any leading batch shape ``[...]`` (typically ``[rows]`` or ``[dp, rows]``);
the sampling settings are *data* (traced arrays), so a step compiles once whatever the requests
ask for. Only ``greedy_only`` is static.

A row whose temperature is 0 takes the argmax of its logits (the first maximum). Any other row:

1. ``probs = softmax(logits / temperature)`` in float32;
2. sort the probabilities in descending order, stably (equal probabilities keep vocabulary
   order);
3. keep the *nucleus*: the sorted tokens whose mass of more likely tokens (the exclusive
   cumulative sum) is below ``top_p``; the first token always stays;
4. invert the cumulative distribution of the kept tokens at ``uniform * kept mass``: the token
   is the first kept one whose inclusive cumulative sum exceeds that target.

The implementation sorts the probabilities alone (``sort_descending``, no vocabulary ids
beside them): every sorted probability, and so every cumulative sum and the chosen sorted
position, is what the stable sort of step 2 gives. Only the token at that position depends on
the order of ties, and ``_tie_ordered_token`` finds the one the stable order puts there,
counting equal probabilities in vocabulary order. (On the GPU, XLA's compiler runs a sort of
keys alone as CUB's radix sort where its size rule prefers CUB, moving no ids beside them.)

The inverse CDF runs in **sorted** order (most likely token first), not in vocabulary order as
the runner's host sampler does: both draw from the same distribution, but one
uniform number maps to different tokens in the two. If rounding leaves the target at or above
the last cumulative sum, the draw is clipped to the last kept token of nonzero probability
(a token whose float32 probability underflowed to 0 is never drawn).

The uniform of a row comes from ``jax.random`` keyed by ``(seed, request index, token index)``
(``sampling_uniforms``): a request's draws depend only on its seed, its index and the position
of the token in its output, never on the DP rank serving it or what it is batched with.

``sample_rows_reference`` is the same definition in float64 numpy, one row at a time.
"""

import jax
import jax.numpy as jnp
import numpy as np


def sampling_uniforms(seed, request_index, token_index) -> jax.Array:
    """One uniform number per row, from ``jax.random``.

    A row's key is ``fold_in(fold_in(key(seed), request_index), token_index)``, so its value
    depends only on those three numbers, never on the row's place in the batch.

    Args:
      seed: ``[...]`` int32 seeds.
      request_index: ``[...]`` int32 index of each row's request.
      token_index: ``[...]`` int32 index of the token being drawn in its request's output.
      (The three are broadcast against each other, so a scalar seed is fine.)

    Returns:
      ``[...]`` float32 in ``[0, 1)``.
    """
    seed, request_index, token_index = jnp.broadcast_arrays(
        jnp.asarray(seed, jnp.int32),
        jnp.asarray(request_index, jnp.int32),
        jnp.asarray(token_index, jnp.int32),
    )
    shape = seed.shape

    def one_row(row_seed, row_request, row_token):
        key = jax.random.fold_in(
            jax.random.fold_in(jax.random.key(row_seed), row_request), row_token
        )
        return jax.random.uniform(key, (), jnp.float32)

    flat = jax.vmap(one_row)(seed.reshape(-1), request_index.reshape(-1), token_index.reshape(-1))
    return flat.reshape(shape)


def sample_rows(logits, temperature, top_p, uniforms, *, greedy_only: bool = False) -> jax.Array:
    """Picks one token per row (see the module docstring for the definition).

    Args:
      logits: ``[..., V]`` logits, any float dtype (computed in float32).
      temperature: ``[...]`` float32; 0 for greedy (argmax), else > 0.
      top_p: ``[...]`` float32 nucleus size in ``(0, 1]``; 1 keeps every token.
      uniforms: ``[...]`` float32 in ``[0, 1)``, from ``sampling_uniforms``.
      greedy_only: static; True skips the sort and returns the argmax of every row, whatever
        its temperature (for batches whose rows are all greedy).

    Returns:
      ``[...]`` int32 token ids.
    """
    logits = jnp.asarray(logits).astype(jnp.float32)  # [..., V]
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [...]
    if greedy_only:
        return greedy_tokens
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    uniforms = jnp.asarray(uniforms, jnp.float32)
    greedy = temperature == 0
    safe_temperature = jnp.where(greedy, 1.0, temperature)  # greedy rows: a harmless 1
    probs = jax.nn.softmax(logits / safe_temperature[..., None], axis=-1)  # [..., V]
    # Computed once: the token is found by comparing the sorted probabilities' bits with
    # these, and XLA would otherwise recompute the division in each fusion that reads them,
    # where its lowering may differ (the same value, other bits).
    probs = jax.lax.optimization_barrier(probs)
    sorted_probs = sort_descending(probs)  # [..., V]
    inclusive = jnp.cumsum(sorted_probs, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(inclusive[..., :1]), inclusive[..., :-1]], axis=-1)
    positions = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
    first = positions == 0  # position 0 always stays
    keep = (before < top_p[..., None]) | first  # a prefix of the sorted tokens
    kept_cumulative = jnp.cumsum(jnp.where(keep, sorted_probs, 0.0), axis=-1)
    kept_mass = kept_cumulative[..., -1]  # [...]
    target = uniforms * kept_mass
    # Kept tokens of nonzero probability form a prefix, and so do those among them whose
    # cumulative sum is <= target: counting the latter finds the first one that exceeds it.
    candidate = keep & (sorted_probs > 0)
    num_candidates = jnp.sum(candidate, axis=-1, dtype=jnp.int32)
    num_below = jnp.sum(
        candidate & (kept_cumulative <= target[..., None]), axis=-1, dtype=jnp.int32
    )
    chosen = jnp.clip(num_below, 0, jnp.maximum(num_candidates - 1, 0))  # sorted position
    sampled = _tie_ordered_token(probs, sorted_probs, chosen)
    return jnp.where(greedy, greedy_tokens, sampled)


def _tie_ordered_token(probs, sorted_probs, chosen) -> jax.Array:
    """The vocabulary id at sorted position ``chosen [...]`` of the stable descending order
    of ``probs [..., V]`` (``sorted_probs`` its values): the position falls among the tokens
    of its probability, after those of larger ones; among them the stable order is the
    vocabulary order, so the token is the one whose count of equal probabilities up to it,
    in vocabulary order, reaches the position's rank in its tie group. Compared as bit
    patterns (``sort_descending``'s keys), so ties are exact."""
    bits = jax.lax.bitcast_convert_type(probs, jnp.uint32)
    sorted_bits = jax.lax.bitcast_convert_type(sorted_probs, jnp.uint32)
    chosen_bits = jnp.take_along_axis(sorted_bits, chosen[..., None], axis=-1)  # [..., 1]
    ahead = jnp.sum(bits > chosen_bits, axis=-1, dtype=jnp.int32)  # more likely tokens
    tied = bits == chosen_bits
    tied_so_far = jnp.cumsum(tied, axis=-1, dtype=jnp.int32)  # inclusive, vocabulary order
    is_token = tied & (tied_so_far == (chosen - ahead + 1)[..., None])
    return jnp.argmax(is_token, axis=-1).astype(jnp.int32)


def sort_descending(probs) -> jax.Array:
    """Each row's probabilities in descending order.

    The sort runs on integer keys alone: a non-negative float's bit pattern grows with its
    value, so the inverted bit patterns in ascending order are the probabilities in
    descending order, and inverting the sorted keys back gives the same floats. A sort of
    unsigned keys alone compares them with a single ``<``: XLA's GPU compiler hands it to
    CUB's radix sort as a sort of keys (where its size rule prefers CUB), with no vocabulary
    ids to carry beside them.

    Args:
      probs: ``[..., V]`` float32 probabilities, all ``>= 0`` (a NaN sorts first).

    Returns:
      ``[..., V]`` float32: the probabilities from the largest.

    Raises:
      ValueError: ``probs`` is not float32 (its bit patterns are the keys).
    """
    if probs.dtype != jnp.float32:
        raise ValueError(f"sort_descending sorts float32 probabilities, got {probs.dtype}")
    keys = jnp.invert(jax.lax.bitcast_convert_type(probs, jnp.uint32))
    # Equal keys are equal bits: stability would change nothing.
    sorted_keys = jax.lax.sort(keys, dimension=probs.ndim - 1, is_stable=False)
    return jax.lax.bitcast_convert_type(jnp.invert(sorted_keys), jnp.float32)


def token_logprobs(logits, tokens) -> jax.Array:
    """Log-probability of each chosen token under the model's raw distribution.

    The raw distribution is ``softmax(logits)``, before temperature and top-p.

    Args:
      logits: ``[..., V]`` logits, any float dtype (computed in float32).
      tokens: ``[...]`` int token ids.

    Returns:
      ``[...]`` float32 ``log_softmax(logits)[token]``.
    """
    log_probs = jax.nn.log_softmax(jnp.asarray(logits).astype(jnp.float32), axis=-1)
    tokens = jnp.asarray(tokens, jnp.int32)
    return jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]


def _reference_row(logits: np.ndarray, temperature: float, top_p: float, uniform: float) -> int:
    """``sample_rows`` for one row ``[V]``, in float64."""
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits / temperature
    weights = np.exp(scaled - scaled.max())
    probs = weights / weights.sum()
    order = np.argsort(-probs, kind="stable")
    ranked = probs[order]
    before = np.cumsum(ranked) - ranked
    num_kept = max(int(np.count_nonzero(before < top_p)), 1)
    kept = ranked[:num_kept]
    cumulative = np.cumsum(kept)
    target = uniform * cumulative[-1]
    num_candidates = max(int(np.count_nonzero(kept > 0)), 1)
    position = int(np.searchsorted(cumulative[:num_candidates], target, side="right"))
    return int(order[min(position, num_candidates - 1)])


def sample_rows_reference(logits, temperature, top_p, uniforms) -> np.ndarray:
    """``sample_rows`` in float64 numpy, one row at a time.

    Args:
      logits: ``[..., V]`` logits.
      temperature: ``[...]``; 0 for greedy.
      top_p: ``[...]`` in ``(0, 1]``.
      uniforms: ``[...]`` in ``[0, 1)``.

    Returns:
      ``[...]`` int32 token ids.
    """
    logits = np.asarray(logits, np.float64)
    batch_shape = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    settings = [
        np.broadcast_to(np.asarray(value, np.float64), batch_shape).reshape(-1)
        for value in (temperature, top_p, uniforms)
    ]
    tokens = [
        _reference_row(row, temp, nucleus, uniform)
        for row, temp, nucleus, uniform in zip(rows, *settings, strict=True)
    ]
    return np.asarray(tokens, np.int32).reshape(batch_shape)
