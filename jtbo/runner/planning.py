"""Host planning of one step over all DP ranks: capacities, TBO decision, split, metadata.

Everything here is numpy on small integers; the result (``StepPlan``) holds exactly the
arrays the jitted step takes plus the static keys that select its compile.

* Capacities: the token capacity is the smallest bucket holding the busiest rank's tokens,
  rounded up to ``attn_tp_size`` (and to ``draft_token_num`` for TARGET_VERIFY), so one compile
  serves every step of that (bucket, attention kind, TBO) key. The attention kind is
  ``verify`` (any rank verifies), ``decode`` (every busy rank decodes) or ``extend`` (anything
  else, including EXTEND ranks next to DECODE ranks).
* TBO agreement (SGLang ``TboDPAttentionPreparer``): TBO runs only if it is enabled, at least
  one rank is busy, all busy ranks run the same TBO-able mode, and every rank's split fits the
  static child capacity (``jtbo.split.plan_fits_capacity``); IDLE ranks can always join.
* Split: ``compute_split_seq_index`` then ``split_batch`` per rank; children's metadata comes
  from the TBO attention backend at the child capacity.
* DP padding mode: MAX_LEN, the mode of replayed compiled steps (SGLang's CUDA-graph default),
  whose buffer sizes depend only on the bucket — SUM_LEN's would change every step.
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
from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode
TBO_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


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
    """

    attn_tp_size: int
    token_buckets: tuple[int, ...]
    seq_capacity: int
    max_context: int
    enable_tbo: bool
    threshold: float
    query_tile: int = 64


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One planned step.

    Attributes:
      capacity: token rows of every rank's buffers.
      child_capacity: TBO child rows, or None when the step runs without TBO.
      mode: static strategy key: the agreed mode with TBO, EXTEND without.
      per_rank: arrays stacked over ranks (the step's ``per_rank`` argument).
      replicated: DP contexts (the step's ``replicated`` argument).
      num_tokens: real tokens of each rank.
    """

    capacity: int
    child_capacity: int | None
    mode: ForwardMode
    per_rank: dict
    replicated: dict
    num_tokens: tuple[int, ...]


def idle_batch() -> split.ForwardBatch:
    """A batch with no sequences (an idle DP rank)."""
    return split.ForwardBatch(
        forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=np.zeros((0,), np.int32)
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _draft_token_num(batches: Sequence[split.ForwardBatch]) -> int | None:
    drafts = {b.spec_info.draft_token_num for b in batches if b.forward_mode.is_target_verify()}
    if len(drafts) > 1:
        raise ValueError(f"TARGET_VERIFY ranks disagree on draft_token_num: {sorted(drafts)}")
    busy = [b.forward_mode for b in batches if not b.forward_mode.is_idle()]
    if drafts and any(mode != ForwardMode.TARGET_VERIFY for mode in busy):
        raise ValueError(
            f"a TARGET_VERIFY step needs every busy rank in TARGET_VERIFY, got "
            f"{[m.name for m in busy]}"
        )
    return drafts.pop() if drafts else None


def _attention_kind(batches: Sequence[split.ForwardBatch], draft: int | None) -> str:
    if draft is not None:
        return "verify"
    busy = [b.forward_mode for b in batches if not b.forward_mode.is_idle()]
    if busy and all(mode.is_decode() for mode in busy):
        return "decode"
    return "extend"


def attention_capacity(
    kind: str, tokens: int, options: PlanOptions, draft: int | None
) -> metadata_lib.AttentionCapacity:
    """Static attention sizes for ``tokens`` rows of an attention ``kind``.

    Args:
      kind: "extend", "decode" or "verify".
      tokens: token rows.
      options: planning options.
      draft: draft tokens per sequence (verify only).

    Returns:
      The ``AttentionCapacity``.
    """
    if kind == "verify":
        return metadata_lib.verify_capacity(tokens // draft, draft, options.max_context)
    if kind == "decode":
        return metadata_lib.decode_capacity(tokens, options.max_context)
    seqs = min(options.seq_capacity, tokens)
    return metadata_lib.extend_capacity(
        tokens, max(seqs, 1), options.max_context, query_tile=options.query_tile
    )


def _split_plan(batches, options: PlanOptions, child_capacity: int):
    """Per-rank ``(children, split_token_index)``, or None when some rank's split does not fit."""
    plans = []
    for batch in batches:
        if batch.forward_mode.is_idle():
            plans.append(((idle_batch(), idle_batch()), 0))
            continue
        lens = None if batch.extend_seq_lens is None else batch.extend_seq_lens.tolist()
        per_seq = split.get_token_num_per_seq(batch.forward_mode, batch.spec_info)
        seq_index = split.compute_split_seq_index(
            batch.forward_mode, batch.num_tokens, lens, per_seq, threshold=options.threshold
        )
        token_index = split.compute_split_token_index(
            seq_index, batch.forward_mode, lens, per_seq, threshold=options.threshold
        )
        if not split.plan_fits_capacity(
            token_index, batch.num_tokens, child_capacity=child_capacity
        ):
            return None
        with_index = dataclasses.replace(batch, tbo_split_seq_index=seq_index)
        children = split.split_batch(
            with_index, attn_tp_size=options.attn_tp_size, threshold=options.threshold
        )
        plans.append((children, token_index))
    return plans


def _tbo_mode(batches) -> ForwardMode | None:
    """The agreed mode when every busy rank runs the same TBO-able mode, else None."""
    busy = {b.forward_mode for b in batches if not b.forward_mode.is_idle()}
    if len(busy) != 1:
        return None
    mode = busy.pop()
    return mode if mode in TBO_MODES else None


def _pad(values, rows: int) -> np.ndarray:
    out = np.zeros((rows,), np.int32)
    out[: len(values)] = values
    return out


def _stack(trees):
    return jax.tree.map(lambda *xs: np.stack(xs), *trees)


def plan_step(batches: Sequence[split.ForwardBatch], options: PlanOptions) -> StepPlan:
    """Plans one step for every DP rank (idle ranks given as ``idle_batch()``).

    Args:
      batches: one host batch per DP rank.
      options: the runner's planning options.

    Returns:
      The ``StepPlan``.

    Raises:
      ValueError: ranks that cannot share a step (verify next to another mode, different
        draft sizes) or a batch larger than the largest bucket.
    """
    draft = _draft_token_num(batches)
    kind = _attention_kind(batches, draft)
    counts = [b.num_tokens for b in batches]
    multiple = math.lcm(options.attn_tp_size, draft or 1)
    capacity = _round_up(split.token_bucket(max(max(counts), 1), options.token_buckets), multiple)
    mode = _tbo_mode(batches) if options.enable_tbo else None
    child_cap, plans = None, None
    if mode is not None:
        child_cap = split.child_capacity(
            capacity,
            threshold=options.threshold,
            attn_tp_size=options.attn_tp_size,
            token_num_per_seq=draft or 1,
        )
        child_cap = _round_up(child_cap, multiple)
        plans = _split_plan(batches, options, child_cap)
    if plans is None:
        child_cap, mode = None, ForwardMode.EXTEND
    return _assemble(batches, options, kind, draft, capacity, child_cap, mode, plans)


def _assemble(batches, options, kind, draft, capacity, child_cap, mode, plans) -> StepPlan:
    full_cap = attention_capacity(kind, capacity, options, draft)
    small_cap = (
        full_cap if child_cap is None else attention_capacity(kind, child_cap, options, draft)
    )
    backend = tbo_backend.TboAttnBackend.init_new(
        backend_lib.NativeAttnBackend, capacity=full_cap, child_capacity=small_cap
    )
    counts = [b.num_tokens for b in batches]
    metadata = [
        backend.init_forward_metadata(b, None if plans is None else plans[r][0])
        for r, b in enumerate(batches)
    ]
    per_rank = dict(
        input_ids=np.stack([_pad(b.input_ids, capacity) for b in batches]),
        positions=np.stack(
            [_pad(np.zeros(0) if b.positions is None else b.positions, capacity) for b in batches]
        ),
        num_tokens=np.asarray(counts, np.int32),
        attn_metadata=_stack([m.primary for m in metadata]),
    )
    mode_kind = padding.DpPaddingMode.MAX_LEN
    tp = options.attn_tp_size
    replicated = dict(dp_context=context_lib.create_dp_context(counts, mode_kind, capacity, tp))
    if plans is not None:
        split_index = np.asarray([p[1] for p in plans], np.int32)
        per_rank["split_token_index"] = split_index
        per_rank["child_metadata"] = tuple(
            _stack([m.children[i] for m in metadata]) for i in (0, 1)
        )
        replicated["child_dp_contexts"] = (
            context_lib.create_dp_context(split_index, mode_kind, child_cap, tp),
            context_lib.create_dp_context(
                np.asarray(counts) - split_index, mode_kind, child_cap, tp
            ),
        )
    return StepPlan(capacity, child_cap, mode, per_rank, replicated, tuple(counts))
