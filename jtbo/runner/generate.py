"""The serving loop over many requests (``ModelRunner.generate``): sampled on the devices and
pipelined, so that the devices never wait for the host.

Each DP rank has its own page-table rows and KV slots. Requests wait in a FIFO queue per rank
and are admitted when a row and ``len(prompt) + max_new_tokens`` slots are free (reserved up
front, so no preemption; ``jtbo.runner.admission``); one that could never fit, or that is
longer than the runner's ``max_context_len``, is refused in its own result and the rest are
served. Every step, each rank either prefills (chunked: at most ``chunk_size`` prompt tokens
over its admitted requests, so a long prompt spans several EXTEND steps), or decodes all its
running requests, or idles; ranks decide independently, so EXTEND ranks meet DECODE and IDLE
ranks in one step. With ``mixed_chunk`` a rank that has both prompt chunks and decodes runs
them together in one MIXED batch (SGLang's mixed chunk): its decode rows are one-token
extends at the end of the batch, and they count against ``chunk_size``.

The step samples each sequence's next token on the devices (``ModelRunner.dispatch``: the
argmax, or temperature / top-p draws keyed by the seed, the request and the token's index,
``jtbo.models.sampler``) and only token ids come back. The loop keeps steps in flight (as
SGLang's overlap scheduler does, ``PIPELINE_DEPTH`` of them by default): it plans and
dispatches step N+1 before it reads step N's tokens, and step N+1's decode rows read their
input ids from step N's device output. A request whose last token is in an older in-flight
step waits until that step is read. Planning
needs only counts (how many tokens each request has been given), never the tokens
themselves; a request's row and slots are released once the step that made its last token has
been read, so a re-run of that step (an EP overflow) still finds them. The tokens are those of
the synchronous loop (``pipeline=False``), which reads every step before planning the next.

Several processes (``jax.distributed``) run this same loop. Every process is given the same
prompts and assigns prompt ``i`` to DP rank ``dp_rank_of(i)`` (round-robin by default) as a
single process would, and validates every prompt itself; each then serves the prompts of its
own DP ranks, each prompt's draws keyed by its global index. Since every rank plans its batches
from its own requests alone, the ranks see the same batches as in a single-process run and the
processes' steps line up one to one. A process that finishes first takes part in the others'
steps with idle ranks (``ModelRunner.step_idle``) until a step finds every rank idle, and then
every process's results are gathered onto every process (``result_exchange``). ``on_token`` and
``step_log`` see this process's prompts and steps. A single process is the case that owns every
rank: its idle step finds every rank idle at once, and it has nothing to gather.
"""

import collections
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from jtbo import split
from jtbo.runner import admission, result_exchange, sampling, token_step

ForwardMode = split.ForwardMode
DEFAULT_CHUNK_SIZE = 8192
"""Prompt tokens a rank prefills per step at most (SGLang's chunked-prefill size on an
H200-class GPU), capped by the runner's largest token bucket (``chunk_size_for``)."""
PIPELINE_DEPTH = 1
"""Dispatched steps ``generate`` keeps in flight while it plans the next (SGLang's overlap
scheduler keeps one). A deeper pipeline makes a request whose token is in an older in-flight
step wait a step, and reads each step later."""


GenerationResult = result_exchange.GenerationResult


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step of ``generate`` (``step_log=``), for benchmarks.

    Attributes:
      kind: "extend" (every busy rank prefills), "decode" (every busy rank decodes) or
        "mixed" (prefill and decode in one step: on different ranks, or in a MIXED batch).
      num_tokens: new tokens over all ranks.
      num_seqs: sequences over all ranks.
      host_s: host seconds to plan and dispatch the step (not waiting for the devices).
      wall_s: seconds from the previous step's tokens reaching the host to this step's (the
        first step: from the loop's start).
    """

    kind: str
    num_tokens: int
    num_seqs: int
    host_s: float
    wall_s: float


def validate_prompt(
    prompt,
    vocab_size: int,
    max_new_tokens: int,
    max_tokens: int,
    max_context_len: int | None = None,
) -> str | None:
    """Returns why a prompt cannot be served, or None.

    Args:
      prompt: token ids.
      vocab_size: the model's vocabulary.
      max_new_tokens: tokens to generate.
      max_tokens: KV slots of one DP rank.
      max_context_len: the longest context a request may hold (None: ``max_tokens``).
    """
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0:
        return f"empty or non-1-D prompt (shape {ids.shape})"
    if ids.min() < 0 or ids.max() >= vocab_size:
        return f"token ids span [{ids.min()}, {ids.max()}], vocabulary is [0, {vocab_size})"
    if ids.size + max_new_tokens > max_tokens:
        return (
            f"prompt of {ids.size} tokens + max_new_tokens={max_new_tokens} exceeds the KV budget"
            f" of {max_tokens} tokens per DP rank"
        )
    if max_context_len is not None and ids.size + max_new_tokens > max_context_len:
        return (
            f"prompt of {ids.size} tokens + max_new_tokens={max_new_tokens} exceeds "
            f"max_context_len={max_context_len}"
        )
    return None


def pipeline_depth(pipeline: bool | int) -> int:
    """The steps ``generate(pipeline=...)`` keeps in flight while it plans the next.

    Raises:
      ValueError: an int below 0, or neither a bool nor an int.
    """
    if isinstance(pipeline, bool):
        return PIPELINE_DEPTH if pipeline else 0
    if not isinstance(pipeline, int) or pipeline < 0:
        raise ValueError(f"pipeline={pipeline!r}: pass a bool or an int >= 0")
    return pipeline


def chunk_size_for(runner) -> int:
    """``generate``'s default chunk size for ``runner``: ``DEFAULT_CHUNK_SIZE``, at most the
    largest token bucket (a larger chunk could not run in one step)."""
    return min(DEFAULT_CHUNK_SIZE, max(runner.options.token_buckets))


def _extend_batch(rank: admission.RankQueue, chunk_size: int):
    """Chunks of the rank's unfinished prompts: (batch, [(request, chunk_len)])."""
    chunks, budget = [], chunk_size
    for request in rank.running:
        left = len(request.prompt) - request.prefilled
        if left and budget:
            chunks.append((request, min(left, budget)))
            budget -= chunks[-1][1]
    if not chunks:
        return None, []
    starts = [r.prefilled for r, _ in chunks]
    lens = [n for _, n in chunks]
    return split.ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(chunks),
        input_ids=np.concatenate(
            [r.prompt[s : s + n] for (r, n), s in zip(chunks, starts, strict=True)]
        ),
        positions=np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)]),
        out_cache_loc=np.concatenate(
            [r.slots[s : s + n] for (r, n), s in zip(chunks, starts, strict=True)]
        ),
        req_pool_indices=[r.row for r, _ in chunks],
        seq_lens=[s + n for s, n in zip(starts, lens, strict=True)],
        extend_seq_lens=lens,
        extend_prefix_lens=starts,
    ), chunks


def _decode_batch(rank: admission.RankQueue, max_new_tokens: int, newest):
    """The rank's decode batch, its requests and each row's token source: the row of the
    newest in-flight step's output that holds the request's last token, or -1 (read on the
    host). A request whose last token is in an older in-flight step waits for it to be read."""
    requests = [
        r
        for r in rank.running
        if 0 < r.dispatched < max_new_tokens
        and (len(r.generated) == r.dispatched or r.source_step is newest)
    ]
    if not requests:
        return None
    positions = [len(r.prompt) + r.dispatched - 1 for r in requests]
    sources = [r.source_row if len(r.generated) < r.dispatched else -1 for r in requests]
    ids = [
        0 if source >= 0 else r.generated[-1] for r, source in zip(requests, sources, strict=True)
    ]
    batch = split.ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(requests),
        input_ids=ids,
        positions=positions,
        out_cache_loc=[r.slots[p] for r, p in zip(requests, positions, strict=True)],
        req_pool_indices=[r.row for r in requests],
        seq_lens=[p + 1 for p in positions],
    )
    return batch, requests, np.asarray(sources, np.int32)


@dataclasses.dataclass
class _RankWork:
    """What one rank runs in a step: its batch, and per sequence the request that gets a
    token from it (None: a prompt chunk that does not finish its prompt)."""

    kind: str  # "extend", "decode" or "idle"
    batch: split.ForwardBatch | None = None
    makes: list = dataclasses.field(default_factory=list)  # [num_seqs] Request | None
    sources: np.ndarray | None = None  # [num_tokens] token sources (decode)


def _mixed_batch(extend: split.ForwardBatch, decode: split.ForwardBatch) -> split.ForwardBatch:
    """One MIXED batch: the prompt chunks of ``extend``, then the decode rows of ``decode``
    as one-token extends (SGLang's mixed chunk)."""
    lens = np.ones(decode.batch_size, np.int64)
    prefix = np.asarray(decode.seq_lens) - 1

    def joined(name, decode_values):
        return np.concatenate([np.asarray(getattr(extend, name)), np.asarray(decode_values)])

    return split.ForwardBatch(
        forward_mode=ForwardMode.MIXED,
        batch_size=extend.batch_size + decode.batch_size,
        input_ids=joined("input_ids", decode.input_ids),
        positions=joined("positions", decode.positions),
        out_cache_loc=joined("out_cache_loc", decode.out_cache_loc),
        req_pool_indices=joined("req_pool_indices", decode.req_pool_indices),
        seq_lens=joined("seq_lens", decode.seq_lens),
        extend_seq_lens=joined("extend_seq_lens", lens),
        extend_prefix_lens=joined("extend_prefix_lens", prefix),
    )


def _plan_rank(
    rank: admission.RankQueue, chunk_size: int, max_new_tokens: int, in_flight, mixed: bool
):
    decoded = _decode_batch(rank, max_new_tokens, in_flight)
    # A mixed step's decode rows take their share of the chunk's token budget.
    budget = chunk_size - (decoded[0].batch_size if mixed and decoded is not None else 0)
    batch, chunks = _extend_batch(rank, budget) if budget > 0 else (None, [])
    if batch is not None:
        makes = [r if r.prefilled + n == len(r.prompt) else None for r, n in chunks]
        for request, n in chunks:
            request.prefilled += n
        if not mixed or decoded is None:
            return _RankWork("extend", batch, makes)
        sources = np.concatenate([np.full(batch.num_tokens, -1, np.int32), decoded[2]])
        return _RankWork("mixed", _mixed_batch(batch, decoded[0]), makes + decoded[1], sources)
    if decoded is None:
        return _RankWork("idle")
    return _RankWork("decode", decoded[0], decoded[1], decoded[2])


def _row_sampling(work: _RankWork, params_of) -> token_step.RowSampling | None:
    """The sampling parameters of a rank's sequences (None: all greedy)."""
    params = [params_of(r) for r in work.makes]
    if all(p.greedy for p in params):
        return None
    return token_step.RowSampling(
        temperature=np.asarray([p.temperature for p in params], np.float32),
        top_p=np.asarray([p.top_p for p in params], np.float32),
        seed=np.asarray([p.seed for p in params], np.int32),
        request_index=np.asarray([0 if r is None else r.request_id for r in work.makes], np.int32),
        token_index=np.asarray([0 if r is None else r.dispatched for r in work.makes], np.int32),
    )


def _mark_dispatched(work: list[_RankWork], step) -> None:
    """Counts the token each sequence of a dispatched step makes and where it will be."""
    for rank_work in work:
        for row, request in enumerate(rank_work.makes):
            if request is not None:
                request.dispatched += 1
                request.source_step, request.source_row = step, row


def _step_kind(work: list[_RankWork]) -> str:
    kinds = {w.kind for w in work} - {"idle"}
    return kinds.pop() if len(kinds) == 1 else "mixed"


class _Loop:
    """The state of one ``generate`` call (see the module docstring)."""

    def __init__(self, runner, ranks, results, max_new_tokens, params_of, on_token, logprobs):
        self.runner, self.ranks, self.results = runner, ranks, results
        self.max_new_tokens, self.params_of = max_new_tokens, params_of
        self.on_token, self.logprobs = on_token, logprobs
        self.made = 0

    def dispatch(self, chunk_size: int, in_flight, mixed_chunk: bool = False):
        """Admits, plans and dispatches one step; returns ``(pending, work)``, or None when
        no rank has work before the in-flight step is read.

        A step with every local rank idle is never dispatched while one is in flight: it has
        nothing to run, and with several processes the others would take it for this
        process having finished (``generate`` then takes idle steps until all are done).
        """
        for rank in self.ranks:
            rank.admit(self.max_new_tokens)
        work = [
            _plan_rank(r, chunk_size, self.max_new_tokens, in_flight, mixed_chunk)
            for r in self.ranks
        ]
        if all(w.batch is None for w in work):
            if in_flight is None:
                raise RuntimeError("no rank can make progress (a request cannot be admitted)")
            return None
        pending = self.runner.dispatch(
            [w.batch for w in work],
            sampling=[None if w.batch is None else _row_sampling(w, self.params_of) for w in work],
            token_sources=[w.sources for w in work],
            after=in_flight,
            logprobs=self.logprobs,
        )
        _mark_dispatched(work, pending)
        return pending, work

    def run(
        self, chunk_size: int, depth: int, step_log, show: bool, mixed_chunk: bool = False
    ) -> None:
        """Serves every queued request, keeping ``depth`` steps in flight while it plans."""
        start = last = time.perf_counter()
        in_flight = collections.deque()  # (pending step, its work, host seconds), oldest first
        while any(r.waiting or r.running for r in self.ranks):
            begin = time.perf_counter()
            newest = in_flight[-1][0] if in_flight else None
            step = self.dispatch(chunk_size, newest, mixed_chunk)
            if step is not None:
                in_flight.append((*step, time.perf_counter() - begin))
            if step is None or len(in_flight) > depth:
                read = in_flight.popleft()
                self.apply(*read[:2])
                last = _log(step_log, read, last)
            if show:
                rate = self.made / max(time.perf_counter() - start, 1e-9)
                print(
                    f"\rgenerated {self.made} tokens, {rate:.1f} tokens/s", end="", file=sys.stderr
                )
        while in_flight:
            read = in_flight.popleft()
            self.apply(*read[:2])
            last = _log(step_log, read, last)

    def apply(self, pending, work: list[_RankWork]) -> None:
        """Reads a step's tokens into its requests; releases the finished ones."""
        for rank, rank_work, out in zip(
            self.ranks, work, self.runner.resolve(pending), strict=True
        ):
            for row, request in enumerate(rank_work.makes):
                if request is not None:
                    self._append(request, out, row)
            for request in [r for r in rank.running if len(r.generated) >= self.max_new_tokens]:
                self.results[request.index] = GenerationResult(
                    request.generated, None, request.logprobs if self.logprobs else None
                )
                rank.release(request)

    def _append(self, request, out: token_step.StepTokens, row: int) -> None:
        token = int(out.tokens[row])
        request.generated.append(token)
        if out.logprobs is not None:
            request.logprobs.append(float(out.logprobs[row]))
        self.made += 1
        if self.on_token is not None:
            self.on_token(request.index, token)


def _params_of(sampling_params, count: int):
    """Per prompt index, its ``SamplingParams`` (one for all, or one per prompt)."""
    if isinstance(sampling_params, sampling.SamplingParams):
        return lambda request: sampling_params
    if len(sampling_params) != count:
        raise ValueError(
            f"sampling_params: {len(sampling_params)} entries for {count} prompts (pass one "
            "SamplingParams for all, or one per prompt)"
        )
    listed = list(sampling_params)
    return lambda request: sampling.GREEDY if request is None else listed[request.index]


def generate(
    runner,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    dp_rank_of: Callable[[int], int] | None = None,
    chunk_size: int | None = None,
    progress: bool | None = None,
    sampling_params: sampling.SamplingParams | Sequence[sampling.SamplingParams] = sampling.GREEDY,
    on_token: Callable[[int, int], None] | None = None,
    logprobs: bool = False,
    pipeline: bool | int = True,
    step_log: list[StepRecord] | None = None,
    request_ids: Sequence[int] | None = None,
    mixed_chunk: bool = False,
) -> list[GenerationResult]:
    """Generation for many prompts over all DP ranks (see the module docstring); with several
    processes every process calls it alike and returns every prompt's result.

    Args:
      runner: a ``ModelRunner``.
      prompts: token-id sequences.
      max_new_tokens: tokens generated per prompt (>= 1).
      dp_rank_of: prompt index -> DP rank; round-robin when None.
      chunk_size: prompt tokens a rank prefills per step; None: ``chunk_size_for(runner)``.
      progress: print tokens/s and, at the end, ``runner.tbo_summary()``; None: on a tty.
      sampling_params: greedy (default) or temperature / top-p with a seed, for every
        prompt or one per prompt; draws depend on the seed, ``request_ids`` and token index.
      on_token: called as ``on_token(prompt_index, token_id)`` for every token of this
        process's prompts once its step has been read (streaming).
      logprobs: also return each token's log-probability (``GenerationResult.logprobs``).
      pipeline: dispatched steps kept in flight while the host plans the next (an int >= 0;
        True: ``PIPELINE_DEPTH``, False: 0). The tokens are the same.
      step_log: a list to append one ``StepRecord`` per step this process dispatched to.
      request_ids: per prompt, the id that keys its random draws; None: its index.
      mixed_chunk: a rank's prompt chunks and decodes run in one MIXED step (SGLang's mixed
        chunk; decode rows count against ``chunk_size``); False: decodes wait for prefill.

    Returns:
      One ``GenerationResult`` per prompt, in order.

    Raises:
      ValueError: ``max_new_tokens`` or ``chunk_size`` below 1, ``pipeline`` below 0,
        ``sampling_params`` or ``request_ids`` of another length than ``prompts``.
    """
    chunk_size = chunk_size_for(runner) if chunk_size is None else chunk_size
    _check_arguments(len(prompts), max_new_tokens, chunk_size, pipeline, request_ids)
    params_of = _params_of(sampling_params, len(prompts))
    assigned = _assign(runner, prompts, max_new_tokens, dp_rank_of)
    ranks, results = _queue(runner, prompts, assigned, request_ids)
    loop = _Loop(runner, ranks, results, max_new_tokens, params_of, on_token, logprobs)
    show = sys.stderr.isatty() if progress is None else progress
    with runner.failure_phase("generate loop", collective=False):
        loop.run(chunk_size, pipeline_depth(pipeline), step_log, show, mixed_chunk)
        while runner.step_idle():  # other processes still serve: take part in their steps
            pass
    if show:
        print(f"\n{runner.tbo_summary()}", file=sys.stderr)
    return result_exchange.gather_results(runner, results, assigned, max_new_tokens, logprobs)


def _log(step_log, read, last: float) -> float:
    """Appends the step just read to ``step_log``; returns the clock of its reading."""
    now = time.perf_counter()
    _, work, host = read
    batches = [w.batch for w in work if w.batch is not None]
    if step_log is not None and batches:  # a step with every rank idle ran nothing
        step_log.append(
            StepRecord(
                kind=_step_kind(work),
                num_tokens=sum(b.num_tokens for b in batches),
                num_seqs=sum(b.batch_size for b in batches),
                host_s=host,
                wall_s=now - last,
            )
        )
    return now


def _check_arguments(count: int, max_new_tokens: int, chunk_size: int, pipeline, request_ids):
    """Raises ValueError for ``generate``'s bad arguments, before any work."""
    pipeline_depth(pipeline)
    if max_new_tokens < 1 or chunk_size < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}, chunk_size={chunk_size} must be >= 1")
    if request_ids is not None and len(request_ids) != count:
        raise ValueError(f"request_ids: {len(request_ids)} entries for {count} prompts")


def _assign(runner, prompts, max_new_tokens: int, dp_rank_of) -> list[tuple[int, str | None]]:
    """Per prompt: ``(DP rank, why it is refused or None)``, the same on every process."""
    out = []
    for index, prompt in enumerate(prompts):
        rank = index % runner.dp_size if dp_rank_of is None else dp_rank_of(index)
        error = validate_prompt(
            prompt, runner.config.vocab_size, max_new_tokens, runner.max_total_tokens,
            runner.max_context_len,
        )  # fmt: skip
        if error is None and not 0 <= rank < runner.dp_size:
            error = f"dp_rank_of({index}) = {rank} outside [0, {runner.dp_size})"
        out.append((rank, error))
    return out


def _queue(runner, prompts, assigned, request_ids):
    """This process's ranks' queues, with each of their valid prompts waiting, and the
    results, with every invalid prompt refused (the others' are filled as they finish)."""
    limit = admission.running_limit(runner.max_running_requests, runner.options.token_buckets)
    local = {rank: i for i, rank in enumerate(runner.local_dp_ranks)}
    ranks = [
        admission.RankQueue(runner.max_running_requests, runner.num_slots, limit) for _ in local
    ]
    results: list[GenerationResult | None] = [None] * len(prompts)
    for index, (prompt, (rank, error)) in enumerate(zip(prompts, assigned, strict=True)):
        if error is not None:
            results[index] = GenerationResult([], error)
        elif rank in local:
            request_id = index if request_ids is None else int(request_ids[index])
            ranks[local[rank]].waiting.append((index, np.asarray(prompt, np.int32), request_id))
    return ranks, results
