"""What a model step reads besides its plan and writes besides its KV pools.

A served step does three things around the model's forward, all inside the jitted program so
that the host sends only the step's own small arrays and reads back only token ids:

* **Page writes.** The request-to-slot page table lives on the devices. A plan carries the
  step's new tokens as ``page_writes`` ``[3, capacity]`` (request row, KV position, pool slot
  of each token row; padding rows name row ``DROPPED_ROW``), and ``write_pages`` scatters them
  into the table before attention reads it. So the host's work per step grows with the step's
  tokens, never with the table (the pool, the request rows or their width).
* **Token sources.** A pipelined serving loop dispatches step N+1 before it has read step N's
  sampled tokens. A decode row whose input is such a token names its row of the previous
  step's token output in ``token_source`` (``-1``: the id the host sent), and
  ``resolve_input_ids`` reads it from that device array (``prev_tokens``).
* **Sampling.** With a ``SamplerKey`` the step returns token ids instead of logits
  (``step_output``): the argmax of every row (``greedy_only``), or temperature / top-p draws
  whose parameters and seeds are data (``per_rank.sampling``, ``jtbo.models.sampler``), so
  one program serves every mix of them. It also returns, per row, whether every logit was
  finite (the numerics guard) and, when asked, each token's log-probability.

Token outputs have a fixed width, the runner's sequences per rank (``SamplerKey.rows``): row
``i`` is sequence ``i`` of the rank's batch (a decode step's rows are its sequences; an extend
step's are its ``logit_rows``). A fixed width keeps ``prev_tokens``' shape the same for every
step, so feeding one step's tokens to the next adds no compile.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jtbo.models import sampler

DROPPED_ROW = 1 << 30
"""Request row of a page write that must not land (a padding token row, a padding slot)."""


@dataclasses.dataclass(frozen=True)
class SamplerKey:
    """How a step turns logits into tokens (static: part of the compile key).

    Attributes:
      rows: token rows returned per DP rank (the runner's sequences per rank).
      greedy_only: every row takes the argmax (no sampling inputs, no sort).
      logprobs: also return each chosen token's log-probability.
    """

    rows: int
    greedy_only: bool = True
    logprobs: bool = False


def write_pages(req_to_token: jax.Array, page_writes: jax.Array) -> jax.Array:
    """Records a step's new tokens in one rank's page table.

    Args:
      req_to_token: ``[max_reqs, max_context]`` int32 page table.
      page_writes: ``[3, capacity]`` int32: request row, KV position, slot per token row;
        rows of ``DROPPED_ROW`` are not written.

    Returns:
      The updated table (in place when the table is donated).
    """
    rows, positions, slots = page_writes
    return req_to_token.at[rows, positions].set(slots, mode="drop")


def resolve_input_ids(
    input_ids: jax.Array, token_source: jax.Array, prev_tokens: jax.Array
) -> jax.Array:
    """Token ids of a step whose rows may read the previous step's sampled tokens.

    Args:
      input_ids: ``[capacity]`` int32 ids sent by the host.
      token_source: ``[capacity]`` int32: a row of ``prev_tokens``, or -1 for ``input_ids``.
      prev_tokens: ``[rows]`` int32 token output of the previous step on this rank.

    Returns:
      ``[capacity]`` int32 ids.
    """
    from_prev = prev_tokens[jnp.clip(token_source, 0, prev_tokens.shape[0] - 1)]
    return jnp.where(token_source >= 0, from_prev, input_ids)


def _fit_rows(x: jax.Array, rows: int) -> jax.Array:
    """``x``'s first ``rows`` rows, padded with zeros when it has fewer."""
    if x.shape[0] >= rows:
        return x[:rows]
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def step_output(logits: jax.Array, sampling: dict | None, key: SamplerKey) -> dict:
    """A served step's outputs from its logits.

    Args:
      logits: ``[rows', vocab]`` logits of one rank (rows' >= the rank's sequences).
      sampling: ``temperature``, ``top_p`` (float32), ``seed``, ``request_index``,
        ``token_index`` (int32), each ``[key.rows]``; None when ``key.greedy_only``.
      key: the sampler's static settings.

    Returns:
      ``tokens`` ``[key.rows]`` int32, ``finite`` ``[key.rows]`` bool (every logit of the row
      is finite) and, with ``key.logprobs``, ``logprobs`` ``[key.rows]`` float32.
    """
    logits = _fit_rows(logits, key.rows)
    if key.greedy_only:
        tokens = sampler.sample_rows(logits, None, None, None, greedy_only=True)
    else:
        uniforms = sampler.sampling_uniforms(
            sampling["seed"], sampling["request_index"], sampling["token_index"]
        )
        tokens = sampler.sample_rows(logits, sampling["temperature"], sampling["top_p"], uniforms)
    out = dict(tokens=tokens.astype(jnp.int32), finite=jnp.isfinite(logits).all(axis=-1))
    if key.logprobs:
        out["logprobs"] = sampler.token_logprobs(logits, tokens)
    return out
