"""Cross-rank agreement on whether a step runs with two-batch overlap (host side).

Port of SGLang's ``TboDPAttentionPreparer``. Every DP rank's micro-batches take part in the same
collectives, so either every rank splits its batch or none does. Each rank reports
``(local_can_run_tbo, forward_mode, local split index, num_tokens)``:

* a rank *can* run TBO when its planner found a split index, unless the step is a real extend
  (not target-verify) while the MoE uses an all-to-all backend in low-latency mode (DeepEP's
  low-latency kernels serve decode-sized batches only);
* an IDLE rank (no batch) can, with split index 0 and no tokens.

TBO runs when TBO is enabled, every rank can, and the modes of all ranks that are not IDLE or
PREBUILT agree (a step of only IDLE/PREBUILT ranks does not run TBO). The agreed plan also
carries the step's DP facts: ``global_num_tokens``, ``is_extend_in_batch``, the DP padding mode
(MAX_LEN for a replayed compiled step) and the static buffer lengths.

Single-controller JAX sees every rank's batch on one host: ``agree_tbo_dp`` takes the list.
Multi-process JAX exchanges the few integers with ``process_allgather``:
``agree_tbo_dp_multiprocess`` takes this process's ranks and returns the same plan everywhere.
"""

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np
from jax.experimental import multihost_utils

from jtbo.collectives import context as context_lib
from jtbo.collectives import padding
from jtbo.split import arith
from jtbo.split import forward_mode as forward_mode_lib
from jtbo.split import padding as split_padding

ForwardMode = forward_mode_lib.ForwardMode


class DeepEPMode(enum.Enum):
    """All-to-all kernel family of the MoE: NORMAL, LOW_LATENCY, or AUTO (per step)."""

    NORMAL = "normal"
    LOW_LATENCY = "low_latency"
    AUTO = "auto"

    def resolve(self, is_extend_in_batch: bool) -> "DeepEPMode":
        """The mode a step uses: AUTO picks NORMAL for steps with an extend, else LOW_LATENCY."""
        if self is not DeepEPMode.AUTO:
            return self
        return DeepEPMode.NORMAL if is_extend_in_batch else DeepEPMode.LOW_LATENCY

    def is_low_latency(self) -> bool:
        """True for LOW_LATENCY."""
        return self is DeepEPMode.LOW_LATENCY


@dataclasses.dataclass(frozen=True)
class LocalTboInfo:
    """What one DP rank reports to the agreement.

    Attributes:
      local_can_run_tbo: whether this rank can split its batch.
      forward_mode: this rank's mode (IDLE for a rank without a batch).
      tbo_split_seq_index: this rank's split sequence index (None: no valid split).
      num_tokens: this rank's token count.
    """

    local_can_run_tbo: bool
    forward_mode: ForwardMode
    tbo_split_seq_index: int | None
    num_tokens: int


IDLE_RANK = LocalTboInfo(True, ForwardMode.IDLE, 0, 0)


def compute_local_tbo_info(
    forward_mode: ForwardMode,
    num_tokens: int,
    tbo_split_seq_index: int | None,
    *,
    enable_a2a_moe: bool = False,
    deepep_mode: DeepEPMode = DeepEPMode.AUTO,
) -> LocalTboInfo:
    """One rank's report (SGLang ``prepare_all_gather``, for a rank with a batch).

    Args:
      forward_mode: the rank's mode.
      num_tokens: the rank's tokens (``batch_size * tokens_per_seq`` for decode/verify).
      tbo_split_seq_index: from ``jtbo.split.compute_split_seq_index`` (None: no valid split).
      enable_a2a_moe: whether the MoE uses an all-to-all backend (DeepEP-style).
      deepep_mode: that backend's kernel mode.

    Returns:
      The report.

    Raises:
      ValueError: a negative ``num_tokens``.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    forward_mode = ForwardMode(forward_mode)
    real_extend = forward_mode.is_extend() and not forward_mode.is_target_verify()
    # A rank's own is_extend_in_batch: an extend rank resolves AUTO to NORMAL.
    low_latency = enable_a2a_moe and deepep_mode.resolve(forward_mode.is_extend()).is_low_latency()
    can_run = tbo_split_seq_index is not None and not (real_extend and low_latency)
    return LocalTboInfo(can_run, forward_mode, tbo_split_seq_index, int(num_tokens))


@dataclasses.dataclass(frozen=True)
class TboDpPlan:
    """The agreed facts of one step.

    Attributes:
      can_run_tbo: whether every rank splits its batch this step.
      global_forward_mode: the agreed mode of the non-idle ranks (None without TBO).
      tbo_split_seq_index: per rank, its split index (None without TBO).
      global_num_tokens: per rank, its token count.
      is_extend_in_batch: whether any rank runs an extend-like step.
      dp_padding_mode: layout of the gathered DP buffer.
      local_buffer_len: rows of each rank's local buffer (static capacity).
      global_buffer_len: rows of the gathered buffer (static capacity).
    """

    can_run_tbo: bool
    global_forward_mode: ForwardMode | None
    tbo_split_seq_index: tuple[int | None, ...]
    global_num_tokens: tuple[int, ...]
    is_extend_in_batch: bool
    dp_padding_mode: padding.DpPaddingMode
    local_buffer_len: int
    global_buffer_len: int


def agree_tbo_dp(
    ranks: Sequence[LocalTboInfo | None],
    *,
    enable_two_batch_overlap: bool,
    attn_tp_size: int = 1,
    token_buckets: Sequence[int] | None = None,
    for_graph_replay: bool = False,
) -> TboDpPlan:
    """Agrees on TBO and the DP layout of a step from every rank's report (single controller).

    Args:
      ranks: one report per DP rank, in rank order; None for a rank without a batch (IDLE).
      enable_two_batch_overlap: the server's TBO switch.
      attn_tp_size: devices per DP rank; buffer lengths are multiples of it.
      token_buckets: increasing capacities the local (and SUM_LEN global) buffer lengths are
        rounded up to, bounding compiles; None rounds only to ``attn_tp_size``.
      for_graph_replay: the step replays a compiled bucket: MAX_LEN padding (SGLang's CUDA-graph
        default) instead of the per-step rule.

    Returns:
      The plan.

    Raises:
      ValueError: no ranks, or a count above the largest bucket.
    """
    if not ranks:
        raise ValueError("ranks must list at least one DP rank")
    reports = [IDLE_RANK if r is None else r for r in ranks]
    global_mode, modes_agree = _global_forward_mode([r.forward_mode for r in reports])
    can_run_tbo = bool(
        enable_two_batch_overlap and all(r.local_can_run_tbo for r in reports) and modes_agree
    )
    counts = tuple(r.num_tokens for r in reports)
    is_extend_in_batch = any(r.forward_mode.is_extend() for r in reports)
    if for_graph_replay:
        mode = padding.DpPaddingMode.get_default_mode_in_cuda_graph()
    else:
        mode = padding.select_dp_padding_mode(is_extend_in_batch, counts)
    local_len, global_len = _buffer_lengths(counts, mode, attn_tp_size, token_buckets)
    return TboDpPlan(
        can_run_tbo=can_run_tbo,
        global_forward_mode=global_mode if can_run_tbo else None,
        tbo_split_seq_index=tuple(r.tbo_split_seq_index if can_run_tbo else None for r in reports),
        global_num_tokens=counts,
        is_extend_in_batch=is_extend_in_batch,
        dp_padding_mode=mode,
        local_buffer_len=local_len,
        global_buffer_len=global_len,
    )


def agree_tbo_dp_multiprocess(local_ranks: Sequence[LocalTboInfo | None], **kwargs) -> TboDpPlan:
    """``agree_tbo_dp`` across processes: each process reports the DP ranks it drives.

    The reports travel as a small int64 table through
    ``jax.experimental.multihost_utils.process_allgather``; every process gets the same plan.
    Every process must drive the same number of ranks, ranks ordered by process then position.

    Args:
      local_ranks: this process's reports (None for an idle rank).
      **kwargs: the keyword arguments of ``agree_tbo_dp``.

    Returns:
      The plan over all processes' ranks.

    Raises:
      ValueError: as ``agree_tbo_dp``.
    """
    table = np.asarray([_encode(r) for r in local_ranks], dtype=np.int64).reshape(-1, 4)
    gathered = np.asarray(multihost_utils.process_allgather(table)).reshape(-1, 4)
    return agree_tbo_dp([_decode(row) for row in gathered], **kwargs)


def dp_context_for(plan: TboDpPlan, attn_tp_size: int = 1) -> context_lib.DpContext:
    """The in-graph ``DpContext`` of a plan's step (counts traced, lengths static)."""
    return context_lib.create_dp_context(
        plan.global_num_tokens,
        plan.dp_padding_mode,
        plan.local_buffer_len,
        attn_tp_size,
        plan.global_buffer_len,
    )


def _global_forward_mode(modes):
    busy = [m for m in modes if m not in (ForwardMode.IDLE, ForwardMode.PREBUILT)]
    if not busy:
        return ForwardMode.IDLE, False
    agree = all(m == busy[0] for m in busy)
    return (busy[0] if agree else None), agree


def _bucket(rows, attn_tp_size, token_buckets):
    rows = max(rows, 1)  # no zero-sized buffers, even when every rank is idle
    if token_buckets is not None:
        rows = split_padding.token_bucket(rows, token_buckets)
    return arith.round_up(rows, attn_tp_size)


def _buffer_lengths(counts, mode, attn_tp_size, token_buckets):
    local_len = _bucket(max(counts), attn_tp_size, token_buckets)
    most = len(counts) * local_len
    if mode.is_max_len():
        return local_len, most
    total = sum(counts)
    if token_buckets is not None and total > token_buckets[-1]:
        return local_len, most  # beyond the buckets: the MAX_LEN size always holds the sum
    return local_len, min(most, _bucket(total, attn_tp_size, token_buckets))


def _encode(report):
    report = IDLE_RANK if report is None else report
    split = -1 if report.tbo_split_seq_index is None else report.tbo_split_seq_index
    return [int(report.local_can_run_tbo), int(report.forward_mode), split, report.num_tokens]


def _decode(row):
    can, mode, split, tokens = (int(v) for v in row)
    return LocalTboInfo(bool(can), ForwardMode(mode), None if split < 0 else split, tokens)
