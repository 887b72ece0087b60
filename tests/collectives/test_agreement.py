"""Cross-rank TBO agreement against a table of SGLang cases."""

import time

import pytest

from jtbo.collectives import agreement, padding
from jtbo.split import ForwardMode as FM

MAX, SUM = padding.DpPaddingMode.MAX_LEN, padding.DpPaddingMode.SUM_LEN


def rank(mode, tokens, split=1, **kwargs):
    return agreement.compute_local_tbo_info(mode, tokens, split, **kwargs)


# (reports, enable_tbo, can_run_tbo, global_forward_mode)
CASES = {
    "all-decode": ([rank(FM.DECODE, 8), rank(FM.DECODE, 6)], True, True, FM.DECODE),
    "tbo-disabled": ([rank(FM.DECODE, 8), rank(FM.DECODE, 6)], False, False, None),
    "mixed-modes": ([rank(FM.EXTEND, 30), rank(FM.DECODE, 6)], True, False, None),
    "idle-rank-can": ([rank(FM.EXTEND, 30), None], True, True, FM.EXTEND),
    "prebuilt-ignored": ([rank(FM.DECODE, 4), rank(FM.PREBUILT, 0, 0)], True, True, FM.DECODE),
    "all-idle": ([None, None], True, False, None),
    "one-rank-no-split": ([rank(FM.DECODE, 8), rank(FM.DECODE, 1, None)], True, False, None),
    "low-latency-extend": (
        [rank(FM.EXTEND, 30, enable_a2a_moe=True, deepep_mode=agreement.DeepEPMode.LOW_LATENCY)],
        True,
        False,
        None,
    ),
    "low-latency-decode": (
        [rank(FM.DECODE, 8, enable_a2a_moe=True, deepep_mode=agreement.DeepEPMode.LOW_LATENCY)],
        True,
        True,
        FM.DECODE,
    ),
    "auto-extend-is-normal": (
        [rank(FM.EXTEND, 30, enable_a2a_moe=True, deepep_mode=agreement.DeepEPMode.AUTO)],
        True,
        True,
        FM.EXTEND,
    ),
    "low-latency-verify": (
        [
            rank(
                FM.TARGET_VERIFY,
                16,
                enable_a2a_moe=True,
                deepep_mode=agreement.DeepEPMode.LOW_LATENCY,
            )
        ],
        True,
        True,
        FM.TARGET_VERIFY,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_sglang_cases(name):
    reports, enable, can_run, mode = CASES[name]
    plan = agreement.agree_tbo_dp(reports, enable_two_batch_overlap=enable)
    assert plan.can_run_tbo is can_run
    assert plan.global_forward_mode == mode
    if can_run:
        assert plan.tbo_split_seq_index == tuple(
            0 if r is None else r.tbo_split_seq_index for r in reports
        )
    else:
        assert set(plan.tbo_split_seq_index) == {None}


def test_dp_facts_and_buffers():
    reports = [rank(FM.EXTEND, 30), None, rank(FM.EXTEND, 7), rank(FM.EXTEND, 1)]
    plan = agreement.agree_tbo_dp(reports, enable_two_batch_overlap=True, attn_tp_size=2)
    assert plan.global_num_tokens == (30, 0, 7, 1) and plan.is_extend_in_batch
    assert plan.dp_padding_mode is SUM  # extend with dp > 1
    assert (plan.local_buffer_len, plan.global_buffer_len) == (30, 38)
    bucketed = agreement.agree_tbo_dp(
        reports, enable_two_batch_overlap=True, attn_tp_size=2, token_buckets=(16, 32, 64)
    )
    assert (bucketed.local_buffer_len, bucketed.global_buffer_len) == (32, 64)
    decode = [rank(FM.DECODE, 8), rank(FM.DECODE, 5)]
    plan = agreement.agree_tbo_dp(decode, enable_two_batch_overlap=True)
    assert plan.dp_padding_mode is MAX and plan.global_buffer_len == 16
    replay = agreement.agree_tbo_dp(reports, enable_two_batch_overlap=True, for_graph_replay=True)
    assert replay.dp_padding_mode is MAX and replay.global_buffer_len == 4 * 30
    context = agreement.dp_context_for(plan)
    assert context.local_capacity == 8 and context.global_num_tokens.tolist() == [8, 5]


def test_multiprocess_matches_single_controller():
    reports = [rank(FM.DECODE, 8), None, rank(FM.DECODE, 3, 2)]
    single = agreement.agree_tbo_dp(reports, enable_two_batch_overlap=True)
    multi = agreement.agree_tbo_dp_multiprocess(reports, enable_two_batch_overlap=True)
    assert multi == single and multi.can_run_tbo


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least one"):
        agreement.agree_tbo_dp([], enable_two_batch_overlap=True)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        rank(FM.DECODE, -1)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        agreement.agree_tbo_dp(
            [rank(FM.DECODE, 70)], enable_two_batch_overlap=True, token_buckets=(32, 64)
        )


def test_agreement_is_fast():
    reports = [rank(FM.DECODE, 256, 128) for _ in range(8)]
    start = time.perf_counter()
    for _ in range(200):
        agreement.agree_tbo_dp(reports, enable_two_batch_overlap=True, attn_tp_size=1)
    per_step = (time.perf_counter() - start) / 200
    assert per_step < 1e-3, per_step  # loose bound for a shared CI core; target is 100 us
