"""The numerics guard: a step whose logits hold a NaN or an infinity raises instead of returning.

A non-finite logit means the step computed garbage (overflow in a low-precision matmul, a bad
weight, an attention row over nothing); returned silently it becomes a wrong token. The runner
(``ModelRunner(check_finite_logits=True)``, the default) reduces each logits row to one flag
on the devices (``finite_rows``: ``[dp, capacity]`` bools, a small read-back next to the
``[dp, capacity, vocab]`` logits) and ``check_finite`` names the first bad row's DP rank, token
row and request: its index in the rank's batch and its request-pool row.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import split


class NonFiniteLogitsError(FloatingPointError):
    """A step's logits held a NaN or an infinity (names the DP rank and the request)."""


@jax.jit
def finite_rows(logits: jax.Array) -> jax.Array:
    """Whether every logit of a row is finite.

    Args:
      logits: ``[dp, capacity, vocab]`` float logits.

    Returns:
      ``[dp, capacity]`` bool, sharded as the logits' leading axes.
    """
    return jnp.isfinite(logits).all(axis=-1)


def sequence_of_row(batch: split.ForwardBatch, row: int) -> int:
    """The index (in the batch) of the sequence that token row ``row`` belongs to.

    Args:
      batch: an unpadded host batch.
      row: a token row below ``batch.num_tokens``.

    Returns:
      The sequence index.
    """
    mode = batch.forward_mode
    if mode.is_decode():
        return row
    if mode.is_target_verify():
        return row // batch.spec_info.draft_token_num
    starts = np.asarray(batch.extend_start_loc)
    return int(np.searchsorted(starts, row, side="right")) - 1


def check_finite(finite, ranks, batches, num_tokens, picked=None) -> None:
    """Raises on the first non-finite row of a real token.

    Args:
      finite: ``[len(ranks), rows]`` bool from ``finite_rows``, rows of ``ranks``.
      ranks: the DP ranks of ``finite``'s rows.
      batches: the ranks' host batches (None: idle), in ``ranks`` order.
      num_tokens: real tokens per DP rank (all ranks).
      picked: per rank of ``ranks``, the token rows ``finite``'s rows stand for (a step that
        computed only those logits rows, ``last_rows``); None: row ``r`` is token row ``r``.

    Raises:
      NonFiniteLogitsError: naming the DP rank, token row, sequence index, request-pool row
        and how many of the rank's rows are bad.
    """
    for i, (rank, batch) in enumerate(zip(ranks, batches, strict=True)):
        rows = np.arange(num_tokens[rank]) if picked is None else np.asarray(picked[i])
        bad = rows[~np.asarray(finite[i, : len(rows)])]
        if batch is None or bad.size == 0:
            continue
        row = int(bad[0])
        seq = sequence_of_row(batch, row)
        pool_row = int(np.asarray(batch.req_pool_indices)[seq])
        raise NonFiniteLogitsError(
            f"DP rank {rank}: non-finite logits in {bad.size} of {len(rows)} token rows; "
            f"first at token row {row}, request index {seq} of the batch (req_pool_indices="
            f"{pool_row}, {batch.forward_mode.name}); ModelRunner(check_finite_logits=False) "
            "returns them unchecked"
        )
