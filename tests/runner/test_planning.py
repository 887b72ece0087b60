"""The step's TBO decision (``planning.decide``) against SGLang's ``TboDPAttentionPreparer`` cases,
and its DP padding mode (SGLang's rule where the SUM_LEN buffer is the smaller).

TBO runs only when it is enabled, some rank is busy, every busy rank runs the same TBO-able
mode, and every busy rank found a split that fits the child capacity; idle ranks join with
split 0. (SGLang's DeepEP low-latency rule, no TBO for a real extend under low-latency
all-to-all kernels, has no counterpart: jtbo has no low-latency exchange.)
"""

import dataclasses

import numpy as np
import pytest

from jtbo.collectives import context as context_lib
from jtbo.collectives import padding
from jtbo.runner import planning
from jtbo.split import ForwardMode as FM
from tests.runner import helpers

OPTIONS = planning.PlanOptions(
    attn_tp_size=1, token_buckets=(16, 64), seq_capacity=8, max_context=256, enable_tbo=True,
    threshold=0.48,
)  # fmt: skip


def rank(mode, tokens, split=None):
    """A rank's summary; ``split`` defaults to half its tokens (None: no split found)."""
    split = tokens // 2 if split is None else split
    return planning.RankSummary(
        mode, tokens, None, 0 if split == -1 else 1, None if split == -1 else split
    )


IDLE = planning.RankSummary(FM.IDLE, 0, None, None, None)

# (ranks, enable_tbo, the agreed TBO mode or None)
CASES = {
    "all-decode": ([rank(FM.DECODE, 8), rank(FM.DECODE, 6)], True, FM.DECODE),
    "tbo-disabled": ([rank(FM.DECODE, 8), rank(FM.DECODE, 6)], False, None),
    "mixed-modes": ([rank(FM.EXTEND, 30), rank(FM.DECODE, 6)], True, None),
    "idle-rank-joins": ([rank(FM.EXTEND, 30), IDLE], True, FM.EXTEND),
    "all-idle": ([IDLE, IDLE], True, None),
    "one-rank-no-split": ([rank(FM.DECODE, 8), rank(FM.DECODE, 6, split=-1)], True, None),
    "split-too-uneven": ([rank(FM.EXTEND, 60, split=2), rank(FM.EXTEND, 30)], True, None),
    "verify": ([rank(FM.TARGET_VERIFY, 8), rank(FM.TARGET_VERIFY, 8)], True, FM.TARGET_VERIFY),
}


@pytest.mark.parametrize("name", CASES)
def test_sglang_agreement_cases(name):
    ranks, enable, want = CASES[name]
    options = dataclasses.replace(OPTIONS, enable_tbo=enable)
    decision = planning.decide(ranks, options)
    if want is None:
        assert decision.child_capacity is None and decision.split_token_index is None
        assert decision.mode == FM.EXTEND  # the plain step's strategy key
        return
    assert decision.mode == want
    assert decision.child_capacity is not None
    idle_splits = [
        s
        for r, s in zip(ranks, decision.split_token_index, strict=True)
        if r.forward_mode.is_idle()
    ]
    assert idle_splits == [0] * len(idle_splits)
    assert decision.num_tokens == tuple(r.num_tokens for r in ranks)


MAX, SUM = padding.DpPaddingMode.MAX_LEN, padding.DpPaddingMode.SUM_LEN

# (ranks, dp_padding, the step's DP padding mode)
PADDING_CASES = {
    # Capacity 64, sum 36 -> SUM_LEN buffer 40 < 2 x 64.
    "skewed-extend": ([rank(FM.EXTEND, 30), rank(FM.EXTEND, 6)], "auto", SUM),
    "extend-next-to-idle": ([rank(FM.EXTEND, 30), IDLE], "auto", SUM),
    # Equal ranks at their bucket: the SUM_LEN buffer would be MAX_LEN's 2 x 16 rows.
    "balanced-extend": ([rank(FM.EXTEND, 16), rank(FM.EXTEND, 16)], "auto", MAX),
    "balanced-decode": ([rank(FM.DECODE, 8)] * 4, "auto", MAX),
    # Decode: SGLang's cost rule, 2 x sum = 18 < dp x max = 32.
    "skewed-decode": ([rank(FM.DECODE, 8), rank(FM.DECODE, 1), IDLE, IDLE], "auto", SUM),
    "one-rank": ([rank(FM.EXTEND, 30)], "auto", MAX),
    "forced-max-len": ([rank(FM.EXTEND, 30), rank(FM.EXTEND, 6)], "max_len", MAX),
    "forced-sum-len": ([rank(FM.DECODE, 8)] * 4, "sum_len", SUM),
}


@pytest.mark.parametrize("name", PADDING_CASES)
def test_dp_padding_mode_per_step(name):
    ranks, choice, want = PADDING_CASES[name]
    decision = planning.decide(ranks, dataclasses.replace(OPTIONS, dp_padding=choice))
    assert decision.dp_padding_mode is want
    assert planning.without_tbo(decision).dp_padding_mode is want


def test_sum_len_contexts_of_a_tbo_plan_are_bucketed():
    options = dataclasses.replace(OPTIONS, attn_tp_size=2, token_buckets=(16, 32))
    big = helpers.Rank().extend({0: list(range(9)), 1: list(range(10, 22))})  # 21 tokens
    small = helpers.Rank().extend({0: [5, 6, 7], 1: [8, 9]})  # 5 tokens
    plan = planning.plan_step([big, small, planning.idle_batch()], options)
    assert plan.child_capacity is not None and plan.capacity == 32
    context = plan.replicated.dp_context
    assert context.padding_mode is SUM and context.global_buffer_len == 28  # 26 -> 28 < 3 x 32
    splits = plan.per_rank.split_token_index
    child_counts = (splits, np.asarray([21, 5, 0]) - splits)
    for child, counts in zip(plan.replicated.child_dp_contexts, child_counts, strict=True):
        assert child.padding_mode is SUM and child.local_capacity == plan.child_capacity
        want = min(context_lib.sum_len_bucket(int(counts.sum()), 2), 3 * plan.child_capacity)
        assert child.global_buffer_len == want
        np.testing.assert_array_equal(child.global_num_tokens, counts)


def test_dp_padding_choices_and_backends():
    assert planning.dp_padding_for_backend("auto", "ep") == "max_len"
    assert planning.dp_padding_for_backend("auto", "none") == "auto"
    assert planning.dp_padding_for_backend("sum_len", "none") == "sum_len"
    with pytest.raises(ValueError, match="dp_padding='sum_len' needs moe_a2a_backend='none'"):
        planning.dp_padding_for_backend("sum_len", "ep")
    with pytest.raises(ValueError, match="dp_padding='min_len' must be one of"):
        dataclasses.replace(OPTIONS, dp_padding="min_len")


@pytest.mark.parametrize("counts", [[None, 3], [0, 1], [16, 2], [17, 0], [40, 33], [300, 1]])
def test_seq_bucket_is_the_busiest_ranks_power_of_two(counts):
    summaries = [dataclasses.replace(IDLE, num_seqs=n) for n in counts]
    got = planning.seq_bucket(summaries, 128)
    if None in counts:
        assert got == 128  # an unknown count: the runner's bound
    else:
        busiest = max(counts)
        powers = [2**k for k in range(4, 8) if 2**k >= busiest]
        assert got == min(powers + [128])


def test_extend_tiles_follow_the_busiest_ranks_sequences():
    options = dataclasses.replace(
        OPTIONS, token_buckets=(64, 256), seq_capacity=128, max_context=512
    )
    few = helpers.Rank().extend({0: list(range(100)), 1: list(range(100, 160))})
    many = helpers.Rank().extend({row: [row, row + 1] for row in range(40)})
    for batches, seqs in (([few, planning.idle_batch()], 16), ([few, many], 64)):
        tbo = planning.plan_step(batches, options)
        plain = planning.plan_step(batches, dataclasses.replace(options, enable_tbo=False))
        assert tbo.child_capacity is not None
        sized = [(plain.per_rank.attn_metadata, plain.capacity)]
        sized += [(md, tbo.child_capacity) for md in tbo.per_rank.child_metadata]
        for metadata, tokens in sized:
            capacity = metadata.capacity
            assert capacity.seq_capacity == seqs
            # The tile bound of ``seqs`` sequences (``extend_capacity``), not of 128.
            assert capacity.num_tiles == seqs + (tokens - seqs) // options.query_tile
            assert metadata.tile_q_len.shape[-1] == capacity.num_tiles


def test_last_logits_plan_carries_each_sequences_last_row_padded_to_the_seq_bound():
    options = dataclasses.replace(OPTIONS, token_buckets=(16, 32))
    big = helpers.Rank().extend({0: list(range(9)), 2: list(range(10, 22))})  # rows 8, 20
    small = helpers.Rank().extend({1: [5, 6, 7]})  # row 2
    batches = [big, small, planning.idle_batch()]
    for tbo in (True, False):
        plan = planning.plan_step(
            batches, dataclasses.replace(options, enable_tbo=tbo), logits="last"
        )
        rows = plan.per_rank.logit_rows
        assert rows.dtype == np.int32 and rows.shape == (3, 8)  # the seq bound (OPTIONS: 8)
        np.testing.assert_array_equal(rows[:, :2], [[8, 20], [2, 0], [0, 0]])
        assert not rows[:, 2:].any()
    assert planning.plan_step(batches, options).per_rank.logit_rows is None
    rank = helpers.Rank()
    rank.extend({0: [1, 2], 3: [4]})
    decode = [rank.decode({0: 5, 3: 6}), planning.idle_batch(), planning.idle_batch()]
    # Decode: the last rows are the first rows, which a step over every row returns in place.
    assert planning.plan_step(decode, options, logits="last").per_rank.logit_rows is None
    with pytest.raises(ValueError, match="logits must be one of"):
        planning.plan_step(batches, options, logits="first")


def test_tbo_step_takes_the_smallest_child_capacity_that_holds_every_split():
    # Bucket 64 at threshold 0.48: the even split's 32 rows, or the bound's 33.
    options = dataclasses.replace(OPTIONS, token_buckets=(64,))
    assert planning.child_capacities(64, FM.EXTEND, None, options) == (32, 33)
    assert planning.child_capacities(64, FM.DECODE, None, options) == (32,)
    even = [rank(FM.EXTEND, 64, split=32), rank(FM.EXTEND, 40), IDLE]
    uneven = [rank(FM.EXTEND, 64, split=33), IDLE]
    assert planning.decide(even, options).child_capacity == 32
    assert planning.decide(uneven, options).child_capacity == 33
    one = dataclasses.replace(options, child_buckets=1)
    assert planning.decide(even, one).child_capacity == 33
    forced = planning.decide(even, options, child_capacity=33)
    assert forced.child_capacity == 33
    assert forced.split_token_index == planning.decide(even, options).split_token_index
    with pytest.raises(ValueError, match=r"child_capacity=40 is not one of this step's \(32, 33\)"):
        planning.decide(even, options, child_capacity=40)
    with pytest.raises(ValueError, match="child_capacity=32 does not hold every rank's split"):
        planning.decide(uneven, options, child_capacity=32)
    plain = dataclasses.replace(options, enable_tbo=False)
    with pytest.raises(ValueError, match="child_capacity=33 for a step that cannot run TBO"):
        planning.decide(even, plain, child_capacity=33)
    with pytest.raises(ValueError, match="child_buckets=0 must be >= 1"):
        dataclasses.replace(options, child_buckets=0)
