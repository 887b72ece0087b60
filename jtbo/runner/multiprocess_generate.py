"""Generation when each process drives only some DP ranks (``jax.distributed``).

Every process is given the same prompts and assigns prompt ``i`` to DP rank
``dp_rank_of(i)`` (round-robin by default) exactly as a single process would. Each process
then runs the ordinary loop (``jtbo.runner.generate``) over its own ranks only, through a view
of the runner whose DP ranks are this process's, with each prompt's draws keyed by its global
index. Since every rank plans its batches from its own requests alone, each rank sees the same
sequence of batches as in a single-process run, and the global steps line up one-to-one: every
loop iteration dispatches one step (with every local rank idle, if need be), so the processes
stay in lockstep.

A process that finishes first keeps joining steps with idle ranks (``step_idle``) until a step
finds every rank of every process idle; then all processes leave together. Finally the
generated tokens (and log-probabilities) are exchanged (``process_allgather``), so every
process returns every prompt's result (``on_token`` sees this process's prompts only);
requests refused by validation are refused identically everywhere, since
every process validates every prompt itself.
"""

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jtbo.runner import generate as generate_lib
from jtbo.runner import sampling


class _LocalRanksView:
    """The runner as the serving loop sees it: only this process's DP ranks."""

    def __init__(self, runner):
        self._runner = runner
        self.dp_size = len(runner.local_dp_ranks)
        self.config = runner.config
        self.max_running_requests = runner.max_running_requests
        self.max_total_tokens = runner.max_total_tokens
        self.max_context_len = runner.max_context_len
        self.num_slots = runner.num_slots
        self.options = runner.options

    def dispatch(self, batches, **kwargs):
        """This process's part of one step (``ModelRunner.dispatch``)."""
        return self._runner.dispatch(batches, **kwargs)

    def resolve(self, pending):
        """This process's tokens of a dispatched step (``ModelRunner.resolve``)."""
        return self._runner.resolve(pending)

    def tbo_summary(self) -> str:
        """How many steps ran TBO and why (``ModelRunner.tbo_summary``)."""
        return self._runner.tbo_summary()


def _assign(runner, prompts, max_new_tokens, dp_rank_of):
    """Per prompt: (DP rank, rejection reason or None), the same on every process."""
    out = []
    for index, prompt in enumerate(prompts):
        rank = index % runner.dp_size if dp_rank_of is None else dp_rank_of(index)
        error = generate_lib.validate_prompt(
            prompt, runner.config.vocab_size, max_new_tokens, runner.max_total_tokens,
            runner.max_context_len,
        )  # fmt: skip
        if error is None and not 0 <= rank < runner.dp_size:
            error = f"dp_rank_of({index}) = {rank} outside [0, {runner.dp_size})"
        out.append((rank, error))
    return out


def _gather_tokens(tokens: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """Every prompt's rows (tokens, log-probabilities) from the process that served it."""
    if jax.process_count() == 1:
        return tokens
    gathered = np.asarray(multihost_utils.process_allgather(tokens))
    return gathered[np.maximum(owner, 0), np.arange(tokens.shape[0])]


def _subset_of(sampling_params, count: int):
    """``indices -> those prompts' sampling parameters`` (one ``SamplingParams`` for all, or
    one per prompt).

    Raises:
      ValueError: a list of another length than the prompts.
    """
    if isinstance(sampling_params, sampling.SamplingParams):
        return lambda indices: sampling_params
    listed = list(sampling_params)
    if len(listed) != count:
        raise ValueError(f"sampling_params: {len(listed)} for {count} prompts")
    return lambda indices: [listed[i] for i in indices]


def _result_rows(served, mine, count: int, max_new_tokens: int, logprobs: bool):
    """``[count, max_new_tokens]`` tokens and log-probabilities (zeros where this process did
    not serve the prompt, or without ``logprobs``) of this process's results."""
    tokens = np.zeros((count, max_new_tokens), np.int32)
    scores = np.zeros((count, max_new_tokens), np.float32)
    for i, result in zip(mine, served, strict=True):
        tokens[i] = result.token_ids
        scores[i] = result.logprobs if logprobs else 0.0
    return tokens, scores


def generate(
    runner,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    dp_rank_of: Callable[[int], int] | None = None,
    chunk_size: int | None = None,
    progress: bool | None = None,
    sampling_params=sampling.GREEDY,
    on_token: Callable[[int, int], None] | None = None,
    logprobs: bool = False,
    pipeline: bool = True,
    mixed_chunk: bool = False,
) -> list[generate_lib.GenerationResult]:
    """Generation across processes (see the module docstring).

    Every process must call it with the same prompts and arguments.

    Args:
      runner: a ``ModelRunner`` (any number of processes).
      prompts: token-id sequences, the same on every process.
      max_new_tokens: tokens generated per prompt (>= 1).
      dp_rank_of: prompt index -> global DP rank; round-robin when None.
      chunk_size: prompt tokens a rank prefills per step (None: ``generate``'s default).
      progress: print this process's progress line; None: only on a terminal.
      sampling_params, logprobs, pipeline, mixed_chunk: as ``jtbo.runner.generate.generate``'s.
      on_token: called for every token of this process's prompts, with the global index.

    Returns:
      One ``GenerationResult`` per prompt, in order, on every process.

    Raises:
      ValueError: ``max_new_tokens`` or ``chunk_size`` below 1.
    """
    if max_new_tokens < 1 or (chunk_size is not None and chunk_size < 1):
        raise ValueError(f"max_new_tokens={max_new_tokens}, chunk_size={chunk_size} must be >= 1")
    mine_of = _subset_of(sampling_params, len(prompts))
    assigned = _assign(runner, prompts, max_new_tokens, dp_rank_of)
    local = {rank: i for i, rank in enumerate(runner.local_dp_ranks)}
    mine = [i for i, (rank, error) in enumerate(assigned) if error is None and rank in local]
    with runner.failure_phase("generate loop", collective=False):
        served = generate_lib.generate(
            _LocalRanksView(runner),
            [prompts[i] for i in mine],
            max_new_tokens=max_new_tokens,
            dp_rank_of=lambda j: local[assigned[mine[j]][0]],
            chunk_size=chunk_size,
            progress=progress,
            sampling_params=mine_of(mine),
            on_token=None if on_token is None else (lambda j, token: on_token(mine[j], token)),
            logprobs=logprobs,
            pipeline=pipeline,
            request_ids=mine,
            mixed_chunk=mixed_chunk,
        )
        while runner.step_idle():  # other processes still serve: take part in their steps
            pass
        tokens, scores = _result_rows(served, mine, len(prompts), max_new_tokens, logprobs)
        owners = np.asarray(
            [runner.dp_rank_owners[rank] if error is None else -1 for rank, error in assigned]
        )
    with runner.failure_phase("gather results", collective=True):
        tokens = _gather_tokens(tokens, owners)
        scores = _gather_tokens(scores, owners) if logprobs else None
    return [
        generate_lib.GenerationResult([], error)
        if error is not None
        else generate_lib.GenerationResult(
            tokens[i].tolist(), None, None if scores is None else scores[i].tolist()
        )
        for i, (_, error) in enumerate(assigned)
    ]
