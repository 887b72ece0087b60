"""A small serving loop over many requests (``ModelRunner.generate``), greedy by default.

Each DP rank has its own page-table rows and KV slots. Requests wait in a FIFO queue per rank
and are admitted when a row and ``len(prompt) + max_new_tokens`` slots are free (reserved up
front, so no preemption; ``jtbo.runner.admission``); one that could never fit is refused in
its result. Every step, each rank either prefills (chunked: at most ``chunk_size`` prompt
tokens over its admitted requests, so a long prompt spans several EXTEND steps), or decodes
all its running requests, or idles; ranks decide independently, so EXTEND ranks meet DECODE
and IDLE ranks in one step. The next token comes from the last row of a request's chunk
(prefill done) or from its decode row, the only rows read back from the devices
(``forward(logits="last")``): the argmax, or a sample (``jtbo.runner.sampling``:
temperature, top-p, a seeded generator per request). Bad requests are rejected before any
device work; the rest keep going.
"""

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from jtbo import split
from jtbo.runner import admission, sampling

ForwardMode = split.ForwardMode


@dataclasses.dataclass
class GenerationResult:
    """The outcome of one prompt.

    Attributes:
      token_ids: generated token ids (empty when rejected).
      error: why the request was rejected, or None.
    """

    token_ids: list[int]
    error: str | None = None


def validate_prompt(prompt, vocab_size: int, max_new_tokens: int, max_tokens: int) -> str | None:
    """Returns why a prompt cannot be served, or None.

    Args:
      prompt: token ids.
      vocab_size: the model's vocabulary.
      max_new_tokens: tokens to generate.
      max_tokens: KV slots of one DP rank.
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
    return None


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


def _decode_batch(rank: admission.RankQueue):
    requests = [r for r in rank.running if r.generated]
    if not requests:
        return None
    positions = [len(r.prompt) + len(r.generated) - 1 for r in requests]
    return split.ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(requests),
        input_ids=[r.generated[-1] for r in requests],
        positions=positions,
        out_cache_loc=[r.slots[p] for r, p in zip(requests, positions, strict=True)],
        req_pool_indices=[r.row for r in requests],
        seq_lens=[p + 1 for p in positions],
    ), requests


def _plan_rank(rank: admission.RankQueue, chunk_size: int):
    batch, chunks = _extend_batch(rank, chunk_size)
    if batch is not None:
        return batch, ("extend", chunks)
    decoded = _decode_batch(rank)
    if decoded is None:
        return None, ("idle", [])
    return decoded[0], ("decode", decoded[1])


def _apply(
    rank: admission.RankQueue, logits: np.ndarray, work, max_new_tokens: int, results, pick
) -> int:
    """Records the next tokens from one rank's logits, one row per sequence of the step (its
    last token's: ``forward(logits="last")``; ``pick(request, row)`` chooses each); returns
    how many tokens it generated."""
    kind, items = work
    made = 0
    if kind == "extend":
        for row, (request, n) in enumerate(items):
            request.prefilled += n
            if request.prefilled == len(request.prompt):
                pick(request, logits[row])
                made += 1
    elif kind == "decode":
        for row, request in enumerate(items):
            pick(request, logits[row])
            made += 1
    for request in [r for r in rank.running if len(r.generated) >= max_new_tokens]:
        results[request.index] = GenerationResult(request.generated[:max_new_tokens])
        rank.release(request)
    return made


def generate(
    runner,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    dp_rank_of: Callable[[int], int] | None = None,
    chunk_size: int = 32,
    progress: bool | None = None,
    sampling_params: sampling.SamplingParams = sampling.GREEDY,
    on_token: Callable[[int, int], None] | None = None,
) -> list[GenerationResult]:
    """Generation for many prompts over all DP ranks (see the module docstring).

    Args:
      runner: a ``ModelRunner``.
      prompts: token-id sequences.
      max_new_tokens: tokens generated per prompt (>= 1).
      dp_rank_of: prompt index -> DP rank; round-robin when None.
      chunk_size: prompt tokens a rank prefills per step.
      progress: print a progress line (tokens/s) and, at the end, how many steps ran TBO
        and why (``runner.tbo_summary()``); None: only on a terminal.
      sampling_params: greedy (default) or temperature / top-p sampling with a seed.
      on_token: called as ``on_token(prompt_index, token_id)`` for every token as soon as it
        is generated (streaming).

    Returns:
      One ``GenerationResult`` per prompt, in order.

    Raises:
      ValueError: ``max_new_tokens`` or ``chunk_size`` below 1.
    """
    if max_new_tokens < 1 or chunk_size < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}, chunk_size={chunk_size} must be >= 1")
    limit = admission.running_limit(runner.max_running_requests, runner.options.token_buckets)
    ranks = [
        admission.RankQueue(runner.max_running_requests, runner.num_slots, limit)
        for _ in range(runner.dp_size)
    ]
    results: list[GenerationResult | None] = [None] * len(prompts)
    for index, prompt in enumerate(prompts):
        rank = index % runner.dp_size if dp_rank_of is None else dp_rank_of(index)
        error = validate_prompt(prompt, runner.config.vocab_size, max_new_tokens,
                                runner.max_total_tokens)  # fmt: skip
        if error is None and not 0 <= rank < runner.dp_size:
            error = f"dp_rank_of({index}) = {rank} outside [0, {runner.dp_size})"
        if error is not None:
            results[index] = GenerationResult([], error)
        else:
            ranks[rank].waiting.append((index, np.asarray(prompt, np.int32)))
    show = sys.stderr.isatty() if progress is None else progress

    def pick(request: admission.Request, row: np.ndarray) -> None:
        if request.generator is None and not sampling_params.greedy:
            request.generator = sampling.request_generator(sampling_params, request.index)
        token = sampling.next_token(row, sampling_params, request.generator)
        request.generated.append(token)
        if on_token is not None and len(request.generated) <= max_new_tokens:
            on_token(request.index, token)

    made, start = 0, time.perf_counter()
    while any(r.waiting or r.running for r in ranks):
        for rank in ranks:
            rank.admit(max_new_tokens)
        planned = [_plan_rank(rank, chunk_size) for rank in ranks]
        if all(batch is None for batch, _ in planned):
            raise RuntimeError("no rank can make progress (a request cannot be admitted)")
        # Only each sequence's last row is sampled: only those rows leave the devices.
        logits = runner.forward([batch for batch, _ in planned], logits="last")
        for rank, out, (_, work) in zip(ranks, logits, planned, strict=True):
            made += _apply(rank, out, work, max_new_tokens, results, pick)
        if show:
            rate = made / max(time.perf_counter() - start, 1e-9)
            print(f"\rgenerated {made} tokens, {rate:.1f} tokens/s", end="", file=sys.stderr)
    if show:
        print(f"\n{runner.tbo_summary()}", file=sys.stderr)
    return results
