"""Steps that return sampled token ids (``ModelRunner.dispatch`` / ``resolve``).

A serving loop needs one token id per sequence, not logits: the step samples on the devices
(``jtbo.models.step_io``) and only ``[dp, rows]`` ids, a finite flag per row and, when asked,
log-probabilities come back. ``dispatch`` plans and enqueues a step and returns a
``PendingStep`` at once (JAX's dispatch is asynchronous); ``resolve`` reads it back later. In
between the host may plan and dispatch the next step, whose decode rows take their input ids
from this step's device output (``token_sources``): the devices never wait for the host.

What ``resolve`` checks is what the synchronous ``forward`` checks, one step later:

* **EP overflow.** A step that dropped routed tokens re-runs with larger capacities, as in
  ``forward``. A step dispatched after it read its tokens (and its K/V), so it re-runs too
  when it is resolved: ``PendingStep.runs`` counts a step's runs, and a step whose source's
  count changed since it was dispatched runs again on the new tokens. The re-runs rewrite the
  same KV slots before reading them, so the result is exactly one run of each step.
* **Non-finite logits** raise ``NonFiniteLogitsError`` naming the step (its index) and the
  request.

This module holds the host-side pieces: the per-row sampling inputs and token sources of a
plan, and the pending step's record.
"""

import dataclasses

import numpy as np

from jtbo.runner import numerics, planning


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Sampling parameters of one DP rank's sequences, in batch order (each ``[num_seqs]``).

    Attributes:
      temperature: 0 for greedy; > 0 scales the logits before the softmax.
      top_p: nucleus mass in (0, 1].
      seed: each request's seed.
      request_index: each request's index (with the seed, it keys the request's draws).
      token_index: the index of the token being drawn among the request's outputs.
    """

    temperature: np.ndarray  # [num_seqs] float32
    top_p: np.ndarray  # [num_seqs] float32
    seed: np.ndarray  # [num_seqs] int32
    request_index: np.ndarray  # [num_seqs] int32
    token_index: np.ndarray  # [num_seqs] int32

    def __post_init__(self):
        sizes = {np.shape(getattr(self, f.name)) for f in dataclasses.fields(self)}
        if len(sizes) != 1 or len(next(iter(sizes))) != 1:
            raise ValueError(f"RowSampling fields must share one 1-D shape, got {sorted(sizes)}")
        temperature, top_p = np.asarray(self.temperature), np.asarray(self.top_p)
        if not (temperature >= 0).all() or not ((top_p > 0) & (top_p <= 1)).all():
            raise ValueError("RowSampling: temperature must be >= 0 and top_p in (0, 1]")

    @property
    def greedy(self) -> bool:
        """Whether every row takes the argmax."""
        return bool((np.asarray(self.temperature) == 0).all())


def add_token_inputs(
    plan: planning.StepPlan, token_sources: list, sampling: list | None, rows: int, greedy: bool
) -> planning.StepPlan:
    """A token step's inputs added to an assembled plan.

    Args:
      plan: the assembled plan.
      token_sources: per local rank, as ``source_rows`` takes them.
      sampling: per local rank, as ``sampling_rows`` takes them (unused when ``greedy``).
      rows: token rows per rank of the step's output.
      greedy: the step takes the argmax of every row (no sampling inputs).

    Returns:
      A copy of ``plan`` with ``per_rank.token_source`` and, unless ``greedy``,
      ``per_rank.sampling``.
    """
    per_rank = dataclasses.replace(
        plan.per_rank,
        token_source=source_rows(token_sources, plan.capacity, rows),
        sampling=None if greedy else sampling_rows(sampling, rows),
    )
    return dataclasses.replace(plan, per_rank=per_rank)


def sampling_rows(sampling: list[RowSampling | None], rows: int) -> dict:
    """A plan's ``per_rank.sampling``: each field ``[ranks, rows]`` (padding rows greedy).

    Args:
      sampling: per local rank, its sequences' parameters (None: greedy or idle).
      rows: token rows per rank of the step's output.

    Returns:
      The arrays.
    """
    out = {
        "temperature": np.zeros((len(sampling), rows), np.float32),
        "top_p": np.ones((len(sampling), rows), np.float32),
        "seed": np.zeros((len(sampling), rows), np.int32),
        "request_index": np.zeros((len(sampling), rows), np.int32),
        "token_index": np.zeros((len(sampling), rows), np.int32),
    }
    for rank, rank_sampling in enumerate(sampling):
        if rank_sampling is None:
            continue
        for name, values in out.items():
            field = np.asarray(getattr(rank_sampling, name))
            values[rank, : field.shape[0]] = field
    return out


def source_rows(token_sources: list[np.ndarray | None], capacity: int, rows: int) -> np.ndarray:
    """A plan's ``per_rank.token_source``: ``[ranks, capacity]`` int32, -1 where the host's
    id stands.

    Args:
      token_sources: per local rank, ``[num_tokens]`` rows of the previous step's token
        output (-1: the batch's own id), or None (every id from the host).
      capacity: the step's token rows per rank.
      rows: the previous step's token rows per rank.

    Raises:
      ValueError: a source outside ``[-1, rows)`` or longer than the step.
    """
    out = np.full((len(token_sources), capacity), -1, np.int32)
    for rank, sources in enumerate(token_sources):
        if sources is None:
            continue
        sources = np.asarray(sources, np.int64)
        if sources.size and (sources.min() < -1 or sources.max() >= rows):
            raise ValueError(
                f"token_sources of local rank {rank} span [{sources.min()}, {sources.max()}], "
                f"outside [-1, {rows})"
            )
        out[rank, : sources.shape[0]] = sources
    return out


@dataclasses.dataclass
class PendingStep:
    """A dispatched token step, not yet read back (``ModelRunner.resolve`` reads it).

    Attributes:
      index: the step's number among the runner's steps (names it in errors).
      plan: the planned step; None when every rank was idle (no device work).
      batches: the local ranks' host batches (None: idle).
      picked: per local rank, the token rows whose tokens are read (one per sequence).
      after: the step whose token output this one's ``token_source`` rows read, or None.
      after_runs: ``after.runs`` when this step was run.
      inputs: the plan's packed inputs on the devices.
      sampler: the step's ``step_io.SamplerKey``.
      dispatchers: the EP dispatchers it last ran with.
      outputs: device ``tokens`` / ``finite`` (/ ``logprobs``) ``[dp, rows]``.
      overflow: device ``[dispatchers, 2]`` dropped assignments of the last run.
      peak_load: device ``[dispatchers, 2]`` peak loads of the last run.
      runs: times the program ran (EP re-runs and re-runs on a source's new tokens add one).
      clock: host clock reads of the step (``step_phases.from_clock``).
      result: the host tokens once resolved.
    """

    index: int
    plan: planning.StepPlan | None
    batches: list
    picked: list
    after: "PendingStep | None" = None
    after_runs: int = 0
    inputs: object = None
    sampler: object = None
    dispatchers: tuple = ()
    outputs: dict | None = None
    overflow: object = None
    peak_load: object = None
    runs: int = 1
    clock: list = dataclasses.field(default_factory=list)
    result: list | None = None

    @property
    def stale(self) -> bool:
        """Whether the step it read tokens from ran again after this one ran."""
        return self.after is not None and self.after.runs != self.after_runs


@dataclasses.dataclass(frozen=True)
class StepTokens:
    """One DP rank's result of a token step.

    Attributes:
      tokens: ``[num_seqs]`` int32 next token of each sequence, in batch order (an extend
        sequence's is sampled from its last row of the step).
      logprobs: ``[num_seqs]`` float32 log-probability of each token under the model's raw
        distribution, or None when not asked for.
    """

    tokens: np.ndarray  # [num_seqs] int32
    logprobs: np.ndarray | None  # [num_seqs] float32


def check_step_inputs(batches, sampling, token_sources, has_after: bool, rows: int) -> None:
    """Refuses per-rank token-step inputs that do not match their batches.

    Args:
      batches, sampling, token_sources: per local rank, as ``ModelRunner.dispatch`` takes them.
      has_after: whether the step names the step whose tokens it reads.
      rows: token rows per rank of that step's output.

    Raises:
      ValueError: lists of another length than ``batches``, parameters for an idle rank or
        of another length than its sequences, token sources of another length than its
        tokens, outside ``[-1, rows)``, or without the step they read.
    """
    if len(sampling) != len(batches) or len(token_sources) != len(batches):
        raise ValueError(
            f"sampling ({len(sampling)}) and token_sources ({len(token_sources)}) need one "
            f"entry per batch ({len(batches)})"
        )
    for rank, (batch, params, sources) in enumerate(
        zip(batches, sampling, token_sources, strict=True)
    ):
        if params is not None and (batch is None or len(params.temperature) != batch.batch_size):
            raise ValueError(f"local rank {rank}: sampling needs one row per sequence")
        if sources is None:
            continue
        if batch is None or len(sources) != batch.num_tokens:
            raise ValueError(f"local rank {rank}: token_sources needs one entry per token")
        if not has_after and (np.asarray(sources) >= 0).any():
            raise ValueError(f"local rank {rank}: token_sources read a step; pass after=")
    longest = max((len(s) for s in token_sources if s is not None), default=0)
    source_rows(token_sources, longest, rows)  # raises on a row outside [-1, rows)


def check_finite_tokens(finite: np.ndarray, pending: PendingStep, step: int) -> None:
    """Raises on the first sampled row whose logits were not finite, naming the step.

    Raises:
      numerics.NonFiniteLogitsError: naming the step, the DP rank and the request.
    """
    plan = pending.plan
    try:
        numerics.check_finite(finite, plan.ranks, pending.batches, plan.num_tokens, pending.picked)
    except numerics.NonFiniteLogitsError as error:
        raise numerics.NonFiniteLogitsError(f"step {step}: {error}") from error


def step_tokens(host: dict, pending: PendingStep) -> list[StepTokens | None]:
    """Each local rank's tokens (its first ``num_seqs`` rows) from a step's host outputs."""
    out = []
    for i, (batch, picked) in enumerate(zip(pending.batches, pending.picked, strict=True)):
        if batch is None:
            out.append(None)
            continue
        n = len(picked)
        logprobs = host.get("logprobs")
        out.append(StepTokens(host["tokens"][i, :n], None if logprobs is None else logprobs[i, :n]))
    return out
