"""A generation's results, and every process's results gathered onto every process.

``generate`` serves each prompt on the process that drives its DP rank; every process
validates every prompt itself, so refusals are known everywhere. At the end each process
holds the results of its own ranks' prompts; with several processes ``gather_results``
exchanges the generated tokens (and log-probabilities) as ``[prompts, max_new_tokens]`` rows
(``process_allgather``), each prompt's row taken from the process that served it, so every
process returns every prompt's result. A single process already holds them all.
"""

import dataclasses

import numpy as np
from jax.experimental import multihost_utils


@dataclasses.dataclass
class GenerationResult:
    """The outcome of one prompt.

    Attributes:
      token_ids: generated token ids (empty when rejected).
      error: why the request was rejected, or None.
      logprobs: each token's log-probability (``generate(logprobs=True)``), else None.
    """

    token_ids: list[int]
    error: str | None = None
    logprobs: list[float] | None = None


def gather_results(runner, results, assigned, max_new_tokens: int, logprobs: bool):
    """Every prompt's result on every process.

    Args:
      runner: the ``ModelRunner`` that served them.
      results: per prompt, this process's result, or None where another process served it.
      assigned: per prompt, ``(DP rank, refusal or None)``, the same on every process.
      max_new_tokens: tokens per served prompt.
      logprobs: whether the results carry log-probabilities.

    Returns:
      One ``GenerationResult`` per prompt.
    """
    if not runner.multiprocess:
        return results
    owners = np.asarray(
        [runner.dp_rank_owners[rank] if error is None else -1 for rank, error in assigned]
    )
    tokens, scores = _rows(results, max_new_tokens)
    with runner.failure_phase("gather results", collective=True):
        tokens = _gather_rows(tokens, owners)
        scores = _gather_rows(scores, owners) if logprobs else None
    return [
        result
        if owner < 0
        else GenerationResult(
            tokens[i].tolist(), None, None if scores is None else scores[i].tolist()
        )
        for i, (result, owner) in enumerate(zip(results, owners, strict=True))
    ]


def _rows(results, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """``[prompts, max_new_tokens]`` tokens and log-probabilities of this process's served
    results (zeros elsewhere)."""
    tokens = np.zeros((len(results), max_new_tokens), np.int32)
    scores = np.zeros((len(results), max_new_tokens), np.float32)
    for i, result in enumerate(results):
        if result is not None and result.error is None:
            tokens[i] = result.token_ids
            scores[i] = 0.0 if result.logprobs is None else result.logprobs
    return tokens, scores


def _gather_rows(rows: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """Every prompt's row from the process that served it (``owner``; -1: refused)."""
    gathered = np.asarray(multihost_utils.process_allgather(rows))
    return gathered[np.maximum(owner, 0), np.arange(rows.shape[0])]
