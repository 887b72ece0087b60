"""Choosing the next token on the device, inside a jitted step: greedy, or temperature + top-p.

Every function takes any leading batch shape ``[...]`` (typically ``[rows]`` or ``[dp, rows]``);
the sampling settings are *data* (traced arrays), so a step compiles once whatever the requests
ask for. Only ``greedy_only`` is static.

A row whose temperature is 0 takes the argmax of its logits (the first maximum). Any other row:

1. ``probs = softmax(logits / temperature)`` in float32;
2. order the tokens by descending probability, equal probabilities in vocabulary order;
3. keep the *nucleus*: the ordered tokens whose mass of more likely tokens (the exclusive
   cumulative sum) is below ``top_p``; the first token always stays;
4. invert the cumulative distribution of the kept tokens at ``uniform * kept mass``: the token
   is the first kept one whose inclusive cumulative sum exceeds that target.

The implementation sorts nothing. Both cuts (3 and 4) are "the first ordered position whose
cumulative sum passes a bound", and the ordered cumulative sum only steps at the tie groups of
equal probabilities. Writing ``mass_above(b)`` for the mass of the tokens whose float32 bit
pattern exceeds ``b`` (a non-negative float's bit pattern grows with its value), the group that
holds the cut is the smallest bit pattern ``b`` with ``mass_above(b)`` below the bound
(``smallest_bits_where``): a search over the bit patterns, each round splitting the interval
left at ``SEARCH_PIVOTS`` pivots with one masked sum over the vocabulary per pivot, fused into
one reduction. Inside the cut's group every token adds the same probability ``v``, so the
tokens of the group before the cut are counted arithmetically (how many multiples of ``v`` fit
between the group's ``mass_above`` and the bound), and ``_tie_ordered_token`` finds that
token among its ties in vocabulary order. The searches read the probabilities a few times
where a sort would move the whole vocabulary; sums of the same probabilities in another order
are what differs from a sorted cumulative sum, a float32 rounding.

The inverse CDF runs in **descending probability** order (most likely token first), not in
vocabulary order as the runner's host sampler does: both draw from the same distribution, but
one uniform number maps to different tokens in the two. If rounding leaves the target at or
above the kept mass, the draw is clipped to the last kept token of nonzero probability (a token
whose float32 probability underflowed to 0 is never drawn).

The uniform of a row comes from ``jax.random`` keyed by ``(seed, request index, token index)``
(``sampling_uniforms``): a request's draws depend only on its seed, its index and the position
of the token in its output, never on the DP rank serving it or what it is batched with.

``sample_rows_reference`` is the same definition in float64 numpy (a stable sort), one row at a
time.
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


SEARCH_PIVOTS = 15
"""Pivots per round of ``smallest_bits_where``: one masked sum each, all fused into one
reduction over the vocabulary. 15 cut the float32 bit patterns of ``[0, 1]`` to one in 8
rounds: more pivots mean fewer rounds (fewer kernels, fewer reads of the probabilities) but
more arithmetic per read."""
ONE_BITS = 0x3F800000
"""The bit pattern of float32 ``1.0``: no probability has a larger one."""


def _search_rounds(pivots: int) -> int:
    """Rounds that shrink an interval of ``ONE_BITS + 1`` bit patterns to one."""
    length, rounds = ONE_BITS + 1, 0
    while length > 1:
        length, rounds = -(-length // (pivots + 1)), rounds + 1
    return rounds


def mass_above(bits, probs, bound_bits) -> jax.Array:
    """``[..., P]`` float32: each row's mass of the tokens whose bit pattern exceeds each of
    ``bound_bits [..., P]`` (``bits``, ``probs``: ``[..., V]``)."""
    # [..., V, P], fused into the sum: the pivots are the minor dimension, so the reduction
    # over the vocabulary is a column reduction in which neighbouring threads take the pivots
    # of one probability, read once, rather than a row reduction per pivot reading the whole
    # row again for each.
    above = bits[..., :, None] > bound_bits[..., None, :]
    return jnp.sum(jnp.where(above, probs[..., :, None], 0.0), axis=-2)


def smallest_bits_where(bits, probs, bound, *, inclusive: bool) -> jax.Array:
    """The smallest bit pattern ``b`` in ``[0, ONE_BITS]`` whose ``mass_above(b)`` is below
    ``bound`` (``inclusive``: at most ``bound``), per row.

    ``mass_above`` only falls as ``b`` grows and is 0 at ``ONE_BITS``, so such a ``b`` exists
    for any ``bound > 0`` (``inclusive``: ``>= 0``). Each round keeps an interval ``(low,
    high]`` with the condition false at ``low`` and true at ``high`` and tests
    ``SEARCH_PIVOTS`` pivots spread over it. The answer is a token's bit pattern (the mass
    drops there) unless the condition already holds at 0.

    Args:
      bits: ``[..., V]`` int32 bit patterns of ``probs``.
      probs: ``[..., V]`` float32 probabilities, all ``>= 0``.
      bound: ``[...]`` float32.
      inclusive: compare with ``<=`` rather than ``<``.

    Returns:
      ``[...]`` int32 bit patterns.
    """
    low = jnp.full(bound.shape, -1, jnp.int32)  # the condition is false "at -1"
    high = jnp.full(bound.shape, ONE_BITS, jnp.int32)
    offsets = jnp.arange(1, SEARCH_PIVOTS + 1, dtype=jnp.int32)
    for _ in range(_search_rounds(SEARCH_PIVOTS)):
        step = (high - low + SEARCH_PIVOTS) // (SEARCH_PIVOTS + 1)  # ceil; at least 1
        pivots = jnp.minimum(low[..., None] + step[..., None] * offsets, high[..., None])
        mass = mass_above(bits, probs, pivots)
        holds = mass <= bound[..., None] if inclusive else mass < bound[..., None]
        high = jnp.min(jnp.where(holds, pivots, high[..., None]), axis=-1)
        low = jnp.max(jnp.where(holds, low[..., None], pivots), axis=-1)
    return high


def _group(bits, probs, group_bits):
    """``(mass above the group, its tokens, their probability)`` of the tie group of bit
    pattern ``group_bits [...]``."""
    above = mass_above(bits, probs, group_bits[..., None])[..., 0]
    size = jnp.sum(bits == group_bits[..., None], axis=-1, dtype=jnp.int32)
    return above, size, jax.lax.bitcast_convert_type(group_bits, jnp.float32)


def _nucleus(bits, probs, top_p):
    """``(bit pattern of the nucleus's last group, its tokens in the nucleus, kept mass)``:
    the group's first ``count`` tokens are those whose exclusive cumulative sum
    ``above + i * value`` is below ``top_p`` (the first always)."""
    last = smallest_bits_where(bits, probs, top_p, inclusive=False)
    above, size, value = _group(bits, probs, last)
    fits = jnp.ceil((top_p - above) / jnp.where(value > 0, value, 1.0))
    count = jnp.where(value > 0, jnp.clip(fits, 1, size), size).astype(jnp.int32)
    return last, count, above + count.astype(jnp.float32) * value


def _drawn_position(bits, probs, nucleus_bits, nucleus_count, target):
    """``(bit pattern of the drawn token's group, its index among the group's ties)``: the
    first kept token whose inclusive cumulative sum exceeds ``target``, clipped to the last
    kept token of nonzero probability."""
    drawn = jnp.maximum(smallest_bits_where(bits, probs, target, inclusive=True), nucleus_bits)
    # Only rounding reaches the group of zeros: the last candidate is then the smallest positive
    # probability's last token (every positive one is kept when the nucleus reaches zero).
    smallest_positive = jnp.min(jnp.where(bits > 0, bits, ONE_BITS), axis=-1)
    drawn = jnp.where(drawn > 0, drawn, smallest_positive)
    above, size, value = _group(bits, probs, drawn)
    kept = jnp.where(drawn == nucleus_bits, nucleus_count, size)
    index = jnp.floor((target - above) / value)
    return drawn, jnp.clip(index, 0, kept - 1).astype(jnp.int32)


def sample_rows(logits, temperature, top_p, uniforms, *, greedy_only: bool = False) -> jax.Array:
    """Picks one token per row (see the module docstring for the definition).

    Args:
      logits: ``[..., V]`` logits, any float dtype (computed in float32).
      temperature: ``[...]`` float32; 0 for greedy (argmax), else > 0.
      top_p: ``[...]`` float32 nucleus size in ``(0, 1]``; 1 keeps every token.
      uniforms: ``[...]`` float32 in ``[0, 1)``, from ``sampling_uniforms``.
      greedy_only: static; True skips the nucleus search and returns the argmax of every row,
        whatever its temperature (for batches whose rows are all greedy).

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
    # Computed once: every search compares these bits, and XLA would otherwise recompute the
    # division in each fusion that reads them, where its lowering may differ (the same value,
    # other bits).
    probs = jax.lax.optimization_barrier(probs)
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)  # grows with the probability
    nucleus_bits, nucleus_count, kept_mass = _nucleus(bits, probs, top_p)
    drawn_bits, index = _drawn_position(
        bits, probs, nucleus_bits, nucleus_count, uniforms * kept_mass
    )
    sampled = _tie_ordered_token(bits, drawn_bits, index)
    return jnp.where(greedy, greedy_tokens, sampled)


def _tie_ordered_token(bits, group_bits, index) -> jax.Array:
    """The vocabulary id of the ``index``-th token (from 0, in vocabulary order) among those
    whose bit pattern is ``group_bits [...]`` (``bits [..., V]``): equal probabilities are
    ordered by vocabulary id, so this is the token at that place of the descending order."""
    tied = bits == group_bits[..., None]
    tied_so_far = jnp.cumsum(tied, axis=-1, dtype=jnp.int32)  # inclusive, vocabulary order
    is_token = tied & (tied_so_far == (index + 1)[..., None])
    return jnp.argmax(is_token, axis=-1).astype(jnp.int32)


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
