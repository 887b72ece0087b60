"""Host planning of one step over all DP ranks: capacities, TBO decision, split, metadata.

Everything here is numpy on small integers; the result (``StepPlan``) holds exactly the
arrays the jitted step takes plus the static keys that select its compile. Planning has three
phases so that it also works when each process of a multi-process run holds only its own DP
ranks' batches:

1. ``summarize`` (per rank, rank-local): the rank's ``RankSummary`` (mode, tokens, draft size,
   TBO split indices) and its TBO children;
2. ``decide`` (global, from the summaries' integers only): bucket, attention kind, TBO
   decision. Multi-process runners exchange the summaries first, so every process decides the
   same from the same integers: no floats beyond the threshold arithmetic, no dict order;
3. ``assemble`` (per rank again): padded inputs and attention metadata of the given ranks, DP
   contexts of all ranks.

* Capacities: the token capacity is the smallest bucket holding the busiest rank's tokens,
  rounded up to ``attn_tp_size`` (and to ``draft_token_num`` for TARGET_VERIFY), so one compile
  serves every step of that (bucket, attention kind, TBO) key. The attention kind is
  ``verify`` (any rank verifies), ``decode`` (every busy rank decodes) or ``extend`` (anything
  else, including EXTEND ranks next to DECODE ranks).
* TBO agreement (SGLang ``TboDPAttentionPreparer``): TBO runs only if it is enabled, at least
  one rank is busy, all busy ranks run the same TBO-able mode, and every rank's split fits a
  static child capacity (``jtbo.split.plan_fits_capacity``); IDLE ranks can always join. The
  step takes the smallest of its bucket's ``child_capacities`` that holds every split: an
  even split runs children of half the bucket, not of the most uneven split's bound.
* Split: ``compute_split_seq_index`` then ``split_batch`` per rank (in ``summarize``, so a
  batch that cannot be split fails before any exchange); children's metadata comes from the
  TBO attention backend at the child capacity.
* DP padding mode (``decide``; the layout of the DP gather that the ``"none"`` MoE backend
  runs, ``jtbo.collectives.padding``): ``PlanOptions.dp_padding`` "max_len" or "sum_len"
  forces one; "auto" applies SGLang's rule per step (``select_dp_padding_mode``: SUM_LEN when
  any rank extends, or when the token sum is well below ``dp * max``) and keeps SUM_LEN only
  where its buffer is smaller than MAX_LEN's ``dp * capacity`` (unequal ranks, or ranks well
  below their bucket). The
  SUM_LEN length is the token sum's bucket (``context.sum_len_bucket``, about four per power
  of two), so a compile serves every step of that (bucket, mode, length) key. Both TBO
  children take the step's mode (as SGLang's children copy it), each with its own length.
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np

from jtbo import split
from jtbo.attention import backend as backend_lib
from jtbo.attention import metadata as metadata_lib
from jtbo.attention import tbo_backend
from jtbo.collectives import context as context_lib
from jtbo.collectives import padding
from jtbo.core import arith
from jtbo.models import plan_arrays
from jtbo.runner import kv_table, last_rows
from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode
TBO_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
DP_PADDING_CHOICES = ("auto", "max_len", "sum_len")
"""Values of ``PlanOptions.dp_padding``."""
DEFAULT_QUERY_TILE = 64  # query rows per attention tile of extend steps (PlanOptions.query_tile)
MIN_SEQ_BUCKET = 16
"""The smallest sequence bound of an extend step's attention tiles (``seq_bucket``)."""


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Static planning options of a runner.

    Attributes:
      attn_tp_size: devices per DP rank.
      token_buckets: increasing token capacities.
      seq_capacity: sequences a rank may hold in one step.
      max_context: the KV page table's width.
      enable_tbo: whether two-batch overlap may run.
      threshold: SGLang's ``tbo_token_distribution_threshold``.
      query_tile: query rows per attention tile for extend steps.
      attention_backend: the backend whose metadata the steps carry (a key of
        ``jtbo.attention.backend.ATTENTION_BACKENDS``; they share one metadata layout).
      dp_padding: the DP padding mode of every step, one of ``DP_PADDING_CHOICES``: "auto"
        picks per step (module docstring), "max_len" / "sum_len" force one.
      child_buckets: TBO child capacities per token bucket (``split.child_capacities``): a
        TBO step takes the smallest that holds its split; each one used is a compile.
    """

    attn_tp_size: int
    token_buckets: tuple[int, ...]
    seq_capacity: int
    max_context: int
    enable_tbo: bool
    threshold: float
    query_tile: int = DEFAULT_QUERY_TILE
    attention_backend: str = "native"
    dp_padding: str = "auto"
    child_buckets: int = split.DEFAULT_CHILD_BUCKETS

    def __post_init__(self):
        """Checks ``dp_padding``, ``query_tile`` and ``child_buckets``.

        Raises:
          ValueError: ``dp_padding`` is not one of ``DP_PADDING_CHOICES``, ``query_tile < 1``
            or ``child_buckets < 1``.
        """
        if self.query_tile < 1:
            raise ValueError(f"query_tile={self.query_tile} must be >= 1")
        split.activations.check_child_buckets(self.child_buckets, "child_buckets")
        if self.dp_padding not in DP_PADDING_CHOICES:
            raise ValueError(f"dp_padding={self.dp_padding!r} must be one of {DP_PADDING_CHOICES}")


def dp_padding_for_backend(dp_padding: str, moe_a2a_backend: str) -> str:
    """The ``PlanOptions.dp_padding`` of a runner's MoE backend.

    Only the ``"none"`` backend gathers DP ranks' rows (``jtbo.models.moe_exchange``); an EP
    step's DP contexts size no buffer, so "auto" is MAX_LEN there (one compile per bucket).

    Args:
      dp_padding: the requested choice, one of ``DP_PADDING_CHOICES``.
      moe_a2a_backend: "ep" or "none".

    Returns:
      ``dp_padding``, or "max_len" for "auto" under EP.

    Raises:
      ValueError: an unknown choice, or "sum_len" under EP (it would change nothing).
    """
    if dp_padding not in DP_PADDING_CHOICES:
        raise ValueError(f"dp_padding={dp_padding!r} must be one of {DP_PADDING_CHOICES}")
    if moe_a2a_backend != "none" and dp_padding == "sum_len":
        raise ValueError(
            f"dp_padding='sum_len' needs moe_a2a_backend='none' (the DP gather), got "
            f"{moe_a2a_backend!r}"
        )
    return "max_len" if moe_a2a_backend != "none" and dp_padding == "auto" else dp_padding


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One planned step.

    Attributes:
      capacity: token rows of every rank's buffers.
      child_capacity: TBO child rows, or None when the step runs without TBO.
      mode: static strategy key: the agreed mode with TBO, EXTEND without.
      per_rank: arrays stacked over ``ranks`` (the step's ``per_rank`` argument); with
        ``logit_rows`` ``[ranks, seq_bound]`` (not None) the step computes only those rows'
        logits.
      replicated: DP contexts (the step's ``replicated`` argument).
      num_tokens: real tokens of each rank (all ranks).
      ranks: the DP ranks whose rows ``per_rank`` holds (all of them for a single process).
    """

    capacity: int
    child_capacity: int | None
    mode: ForwardMode
    per_rank: plan_arrays.PerRankInputs
    replicated: plan_arrays.ReplicatedInputs
    num_tokens: tuple[int, ...]
    ranks: tuple[int, ...]


def idle_batch() -> split.ForwardBatch:
    """A batch with no sequences (an idle DP rank)."""
    return split.ForwardBatch(
        forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=np.zeros((0,), np.int32)
    )


@dataclasses.dataclass(frozen=True)
class RankSummary:
    """The integers of one DP rank that every rank's plan depends on.

    Multi-process runners exchange these (``jtbo.runner.step_exchange``), so every process
    derives the same bucket, attention kind and TBO decision.

    Attributes:
      forward_mode: the rank's mode (IDLE for an idle rank).
      num_tokens: the rank's token rows.
      draft_token_num: tokens per sequence of a TARGET_VERIFY rank, else None.
      split_seq_index: the rank's TBO split sequence index, None when not computed.
      split_token_index: the rank's TBO split token index, None when not computed.
      num_seqs: the rank's sequences (a TBO child holds at most as many); None when not
        known, which bounds the step's attention tiles by ``PlanOptions.seq_capacity``.
    """

    forward_mode: ForwardMode
    num_tokens: int
    draft_token_num: int | None
    split_seq_index: int | None
    split_token_index: int | None
    num_seqs: int | None = None


@dataclasses.dataclass(frozen=True)
class LocalRank:
    """One rank's host batch with its summary and, when planned, its TBO children.

    Attributes:
      batch: the rank's unpadded host batch.
      summary: its ``RankSummary``.
      children: ``split_batch`` children at ``summary.split_seq_index``, or None.
    """

    batch: split.ForwardBatch
    summary: RankSummary
    children: tuple[split.ForwardBatch, split.ForwardBatch] | None


@dataclasses.dataclass(frozen=True)
class StepDecision:
    """The step's global facts, derived from every rank's ``RankSummary`` alone.

    Attributes:
      kind: attention kind ("extend", "decode" or "verify").
      draft_token_num: draft size of a verify step, else None.
      capacity: token rows of every rank's buffers.
      child_capacity: TBO child rows, or None without TBO.
      mode: static strategy key: the agreed mode with TBO, EXTEND without.
      num_tokens: real tokens of each rank.
      split_token_index: per rank, the TBO token split (0 for idle ranks); None without TBO.
      dp_padding_mode: layout of the step's DP gathers (``dp_padding_mode``).
      seq_bound: sequences every rank's (and TBO child's) extend attention metadata holds
        (``seq_bucket``).
    """

    kind: str
    draft_token_num: int | None
    capacity: int
    child_capacity: int | None
    mode: ForwardMode
    num_tokens: tuple[int, ...]
    split_token_index: tuple[int, ...] | None
    dp_padding_mode: padding.DpPaddingMode
    seq_bound: int

    @property
    def all_idle(self) -> bool:
        """Whether no rank has a token (the step does no work)."""
        return not any(self.num_tokens)


def summarize(batch: split.ForwardBatch, options: PlanOptions) -> LocalRank:
    """A rank's summary and, when TBO may split it, its children (rank-local work only).

    Args:
      batch: the rank's host batch (``idle_batch()`` for an idle rank).
      options: planning options.

    Returns:
      The ``LocalRank``.

    Raises:
      ValueError: a batch the split planner cannot split (names the field and numbers).
    """
    mode = batch.forward_mode
    draft = batch.spec_info.draft_token_num if mode.is_target_verify() else None
    seqs = batch.batch_size
    if not (options.enable_tbo and mode in TBO_MODES):
        summary = RankSummary(mode, batch.num_tokens, draft, None, None, seqs)
        return LocalRank(batch, summary, None)
    lens = None if batch.extend_seq_lens is None else batch.extend_seq_lens.tolist()
    per_seq = split.get_token_num_per_seq(mode, batch.spec_info)
    seq_index = split.compute_split_seq_index(
        mode, batch.num_tokens, lens, per_seq, threshold=options.threshold
    )
    children = split.split_batch(
        dataclasses.replace(batch, tbo_split_seq_index=seq_index),
        attn_tp_size=options.attn_tp_size,
        threshold=options.threshold,
    )
    token_index = int(children[0].tbo_parent_token_range[1])  # split_batch's token split
    summary = RankSummary(mode, batch.num_tokens, draft, seq_index, token_index, seqs)
    return LocalRank(batch, summary, children)


def _draft_token_num(summaries: Sequence[RankSummary]) -> int | None:
    drafts = {s.draft_token_num for s in summaries if s.draft_token_num is not None}
    if len(drafts) > 1:
        raise ValueError(f"TARGET_VERIFY ranks disagree on draft_token_num: {sorted(drafts)}")
    busy = [s.forward_mode for s in summaries if not s.forward_mode.is_idle()]
    if drafts and any(mode != ForwardMode.TARGET_VERIFY for mode in busy):
        raise ValueError(
            f"a TARGET_VERIFY step needs every busy rank in TARGET_VERIFY, got "
            f"{[m.name for m in busy]}"
        )
    return drafts.pop() if drafts else None


def _attention_kind(summaries: Sequence[RankSummary], draft: int | None) -> str:
    if draft is not None:
        return "verify"
    busy = [s.forward_mode for s in summaries if not s.forward_mode.is_idle()]
    if busy and all(mode.is_decode() for mode in busy):
        return "decode"
    return "extend"


def seq_bucket(summaries: Sequence[RankSummary], seq_capacity: int) -> int:
    """The sequences an extend step's attention metadata is sized for.

    An extend capacity's tile count grows with the sequences it may hold
    (``metadata.extend_capacity``), and every tile costs the attention kernel a program and
    its query rows a gather and scatter. So the bound is the busiest rank's sequence count
    rounded up to a power of two (at least ``MIN_SEQ_BUCKET``: few buckets, few compiles),
    not the runner's ``seq_capacity``; a TBO child holds at most its parent's sequences.

    Args:
      summaries: one ``RankSummary`` per DP rank.
      seq_capacity: the runner's most sequences per rank (the bound's ceiling, and the bound
        when some summary does not know its count).

    Returns:
      The bound, at most ``seq_capacity``.
    """
    counts = [s.num_seqs for s in summaries]
    if any(count is None for count in counts):
        return seq_capacity
    return min(arith.power_of_two_at_least(max(counts, default=0), MIN_SEQ_BUCKET), seq_capacity)


def attention_capacity(
    kind: str, tokens: int, options: PlanOptions, draft: int | None, seq_bound: int
) -> metadata_lib.AttentionCapacity:
    """Static attention sizes for ``tokens`` rows of an attention ``kind``.

    Args:
      kind: "extend", "decode" or "verify".
      tokens: token rows.
      options: planning options.
      draft: draft tokens per sequence (verify only).
      seq_bound: sequences an extend batch holds at most (``seq_bucket``).

    Returns:
      The ``AttentionCapacity``.
    """
    if kind == "verify":
        return metadata_lib.verify_capacity(tokens // draft, draft, options.max_context)
    if kind == "decode":
        return metadata_lib.decode_capacity(tokens, options.max_context)
    seqs = min(seq_bound, options.seq_capacity, tokens)
    return metadata_lib.extend_capacity(
        tokens, max(seqs, 1), options.max_context, query_tile=options.query_tile
    )


def _tbo_mode(summaries: Sequence[RankSummary]) -> ForwardMode | None:
    """The agreed mode when every busy rank runs the same TBO-able mode, else None."""
    busy = {s.forward_mode for s in summaries if not s.forward_mode.is_idle()}
    if len(busy) != 1:
        return None
    mode = busy.pop()
    return mode if mode in TBO_MODES else None


def _split_indices(summaries, child_capacity: int) -> tuple[int, ...] | None:
    """Every rank's token split (idle: 0), or None when some rank's split does not fit."""
    indices = []
    for s in summaries:
        if s.forward_mode.is_idle():
            indices.append(0)
        elif s.split_token_index is None or not split.plan_fits_capacity(
            s.split_token_index, s.num_tokens, child_capacity=child_capacity
        ):
            return None
        else:
            indices.append(s.split_token_index)
    return tuple(indices)


def dp_padding_mode(
    summaries: Sequence[RankSummary], capacity: int, options: PlanOptions
) -> padding.DpPaddingMode:
    """The step's DP padding mode (module docstring), from every rank's summary.

    Args:
      summaries: one ``RankSummary`` per DP rank, in rank order.
      capacity: the step's token rows per rank.
      options: planning options (``dp_padding``, ``attn_tp_size``).

    Returns:
      The forced mode, or with "auto" SGLang's choice where its SUM_LEN buffer is smaller
      than MAX_LEN's, else MAX_LEN.
    """
    if options.dp_padding != "auto":
        return padding.DpPaddingMode[options.dp_padding.upper()]
    counts = [int(s.num_tokens) for s in summaries]
    is_extend_in_batch = any(s.forward_mode.is_extend() for s in summaries)
    mode = padding.select_dp_padding_mode(is_extend_in_batch, counts)
    sum_len = context_lib.default_global_buffer_len(counts, mode, capacity, options.attn_tp_size)
    if mode.is_sum_len() and sum_len >= len(counts) * capacity:
        # The buffer would be as long as MAX_LEN's: the all-reduce then moves twice the rows
        # of the all-gather and the experts run over as many.
        return padding.DpPaddingMode.MAX_LEN
    return mode


def child_capacities(
    capacity: int, mode: ForwardMode, draft_token_num: int | None, options: PlanOptions
) -> tuple[int, ...]:
    """The child capacities a TBO step of this bucket and mode picks from, in increasing order.

    Args:
      capacity: the step's token rows per rank.
      mode: the agreed TBO mode.
      draft_token_num: the verify step's draft size, else None.
      options: planning options (``threshold``, ``attn_tp_size``, ``child_buckets``).

    Returns:
      ``split.child_capacities`` of the step, each rounded up like the capacity (to
      ``attn_tp_size`` and the draft size).
    """
    values = split.child_capacities(
        capacity,
        count=options.child_buckets,
        threshold=options.threshold,
        attn_tp_size=options.attn_tp_size,
        token_num_per_seq=draft_token_num or 1,
        decode_like=mode.is_decode() or mode.is_target_verify(),
    )
    multiple = _capacity_multiple(options, draft_token_num)
    return tuple(sorted({arith.round_up(value, multiple) for value in values}))


def _capacity_multiple(options: PlanOptions, draft_token_num: int | None) -> int:
    """What a step's capacities are multiples of: ``attn_tp_size`` and the draft size."""
    return math.lcm(options.attn_tp_size, draft_token_num or 1)


def _fitting_child(summaries, choices, forced: int | None):
    """The smallest of ``choices`` (or ``forced``) that holds every rank's split, and the
    splits; (None, None) when none does."""
    if forced is not None:
        if forced not in choices:
            raise ValueError(f"child_capacity={forced} is not one of this step's {choices}")
        indices = _split_indices(summaries, forced)
        if indices is None:
            raise ValueError(f"child_capacity={forced} does not hold every rank's split")
        return forced, indices
    for choice in choices:
        indices = _split_indices(summaries, choice)
        if indices is not None:
            return choice, indices
    return None, None


def decide(
    summaries: Sequence[RankSummary], options: PlanOptions, *, child_capacity: int | None = None
) -> StepDecision:
    """The step's global facts from every rank's summary (deterministic integer arithmetic).

    Args:
      summaries: one ``RankSummary`` per DP rank, in rank order.
      options: planning options.
      child_capacity: with TBO, this one of ``child_capacities`` instead of the smallest that
        holds the splits (warm-up compiles each); None: the smallest.

    Returns:
      The ``StepDecision``.

    Raises:
      ValueError: ranks that cannot share a step (verify next to another mode, different
        draft sizes), a rank with more tokens than the largest bucket, or a ``child_capacity``
        that is not one of the step's, does not hold its splits, or is given for a step that
        cannot run TBO.
    """
    draft = _draft_token_num(summaries)
    kind = _attention_kind(summaries, draft)
    counts = tuple(int(s.num_tokens) for s in summaries)
    capacity = arith.round_up(
        split.token_bucket(max(max(counts), 1), options.token_buckets),
        _capacity_multiple(options, draft),
    )
    mode = _tbo_mode(summaries) if options.enable_tbo else None
    child_cap, indices = None, None
    if mode is None and child_capacity is not None:
        raise ValueError(f"child_capacity={child_capacity} for a step that cannot run TBO")
    if mode is not None:
        choices = child_capacities(capacity, mode, draft, options)
        child_cap, indices = _fitting_child(summaries, choices, child_capacity)
    if indices is None:
        child_cap, mode = None, ForwardMode.EXTEND
    padding_mode = dp_padding_mode(summaries, capacity, options)
    seqs = seq_bucket(summaries, options.seq_capacity)
    return StepDecision(kind, draft, capacity, child_cap, mode, counts, indices, padding_mode, seqs)


def without_tbo(decision: StepDecision) -> StepDecision:
    """The same step planned without two-batch overlap (what ``decide`` gives with TBO off).

    Args:
      decision: a step's decision, with or without TBO.

    Returns:
      The decision with no child capacity, no split and the plain step's mode (EXTEND).
    """
    return dataclasses.replace(
        decision, child_capacity=None, mode=ForwardMode.EXTEND, split_token_index=None
    )


def plan_step(
    batches: Sequence[split.ForwardBatch], options: PlanOptions, *, logits: str = "all"
) -> StepPlan:
    """Plans one step for every DP rank (idle ranks given as ``idle_batch()``).

    Args:
      batches: one host batch per DP rank.
      options: the runner's planning options.
      logits: ``"all"`` (every token's row) or ``"last"`` (each sequence's last row,
        ``last_rows``), the logits the step computes.

    Returns:
      The ``StepPlan`` (rows for every rank).

    Raises:
      ValueError: ranks that cannot share a step (verify next to another mode, different
        draft sizes), a batch larger than the largest bucket, or ``"last"`` for a batch
        without one row per sequence (``last_rows.last_rows``).
    """
    return plan_step_for_ranks(batches, range(len(batches)), options, logits=logits)


def plan_step_for_ranks(
    batches: Sequence[split.ForwardBatch],
    ranks: Sequence[int],
    options: PlanOptions,
    *,
    logits: str = "all",
    child_capacity: int | None = None,
) -> StepPlan:
    """Plans a step whose batches every process knows, keeping only ``ranks``' rows.

    Args:
      batches: one host batch per DP rank (all ranks).
      ranks: the DP ranks whose per-rank rows the plan holds.
      options: planning options.
      logits: ``"all"`` or ``"last"`` (see ``plan_step``).
      child_capacity: a TBO step's child capacity instead of the smallest that fits (see
        ``decide``).

    Returns:
      The ``StepPlan``.

    Raises:
      ValueError: what ``decide`` raises.
    """
    last_rows.check_mode(logits)
    local = [summarize(b, options) for b in batches]
    decision = decide([r.summary for r in local], options, child_capacity=child_capacity)
    picked = [last_rows.last_rows(batches[r]) for r in ranks] if logits == "last" else None
    return assemble([local[r] for r in ranks], ranks, decision, options, picked)


def assemble(
    local: Sequence[LocalRank],
    ranks: Sequence[int],
    decision: StepDecision,
    options: PlanOptions,
    picked: Sequence[np.ndarray] | None = None,
) -> StepPlan:
    """The step's arrays: per-rank rows for ``ranks``, replicated DP contexts for all ranks.

    Args:
      local: ``summarize`` results of the ranks in ``ranks``, same order.
      ranks: DP ranks of ``local``.
      decision: from ``decide`` over every rank.
      options: planning options.
      picked: per rank of ``ranks``, the token rows whose logits the step computes
        (``last_rows.last_rows``; empty for an idle rank), padded to ``decision.seq_bound``
        as ``per_rank.logit_rows``; None, or a decode step (whose picked rows are its
        first rows, which a step over every row returns in place): every row.

    Returns:
      The ``StepPlan``.

    Raises:
      ValueError: ``local`` and ``ranks`` differ in length (or ``picked``), a TBO step whose
        rank has no children, or a rank with more picked rows than ``decision.seq_bound``.
    """
    if len(local) != len(ranks) or (picked is not None and len(picked) != len(ranks)):
        raise ValueError(f"got {len(local)} local ranks for ranks {tuple(ranks)}")
    children = None
    if decision.child_capacity is not None:
        children = []
        for rank, item in zip(ranks, local, strict=True):
            if item.batch.forward_mode.is_idle():
                children.append((idle_batch(), idle_batch()))
            elif item.children is None:
                raise ValueError(f"rank {rank}: a TBO step needs the rank's split children")
            else:
                children.append(item.children)
    plan = _assemble([r.batch for r in local], tuple(ranks), options, decision, children)
    # A decode step's last rows are its first rows (one token per sequence): the step computes
    # them without a gather (the caller reads each rank's first len(picked) rows either way).
    if picked is not None and decision.kind != "decode":
        rows = last_rows.row_index(list(picked), decision.seq_bound)
        plan = dataclasses.replace(
            plan, per_rank=dataclasses.replace(plan.per_rank, logit_rows=rows)
        )
    return plan


def _pad(values, rows: int) -> np.ndarray:
    out = np.zeros((rows,), np.int32)
    out[: len(values)] = values
    return out


def _stack(trees):
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def _assemble(batches, ranks, options, decision: StepDecision, children) -> StepPlan:
    kind, draft, capacity = decision.kind, decision.draft_token_num, decision.capacity
    child_cap = decision.child_capacity
    seqs = decision.seq_bound
    full_cap = attention_capacity(kind, capacity, options, draft, seqs)
    small_cap = (
        full_cap if child_cap is None else attention_capacity(kind, child_cap, options, draft, seqs)
    )
    backend = tbo_backend.TboAttnBackend.init_new(
        backend_lib.backend_class(options.attention_backend),
        capacity=full_cap,
        child_capacity=small_cap,
    )
    per_rank = plan_arrays.PerRankInputs(
        input_ids=np.stack([_pad(b.input_ids, capacity) for b in batches]),
        positions=np.stack(
            [_pad(np.zeros(0) if b.positions is None else b.positions, capacity) for b in batches]
        ),
        num_tokens=np.asarray([b.num_tokens for b in batches], np.int32),
        page_writes=np.stack([kv_table.write_rows(b, capacity) for b in batches]),
    )
    if children is None:
        metadata = [backend.primary.init_forward_metadata(b) for b in batches]
        per_rank = dataclasses.replace(per_rank, attn_metadata=_stack(metadata))
    counts = np.asarray(decision.num_tokens, np.int32)
    mode_kind = decision.dp_padding_mode
    tp = options.attn_tp_size
    replicated = plan_arrays.ReplicatedInputs(
        dp_context=context_lib.create_dp_context(counts, mode_kind, capacity, tp)
    )
    if children is not None:
        split_index = np.asarray(decision.split_token_index, np.int32)
        # A TBO step runs every layer per micro-batch: the whole batch's metadata would be
        # built, packed and sent for nothing (a sizeable part of a TBO step's planning).
        metadata = [backend.init_children_metadata(children[i]) for i in range(len(batches))]
        per_rank = dataclasses.replace(
            per_rank,
            split_token_index=split_index[list(ranks)],
            child_metadata=tuple(_stack([m[i] for m in metadata]) for i in (0, 1)),
        )
        replicated = dataclasses.replace(
            replicated,
            child_dp_contexts=(
                context_lib.create_dp_context(split_index, mode_kind, child_cap, tp),
                context_lib.create_dp_context(counts - split_index, mode_kind, child_cap, tp),
            ),
        )
    return StepPlan(
        capacity, child_cap, decision.mode, per_rank, replicated, decision.num_tokens, ranks
    )
