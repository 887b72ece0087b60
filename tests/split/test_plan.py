"""Host split planning against SGLang cases and a brute-force reference."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from jtbo.split import (
    ForwardMode,
    compute_split_seq_index,
    compute_split_token_index,
    compute_tbo_children_num_token_non_padded,
    get_token_num_per_seq,
    plan_extend_split,
)

EXTEND = ForwardMode.EXTEND


def balanced_reference(lens):
    """Last cut with the globally smallest |left - right| (the scan's result for lens >= 0)."""
    if len(lens) < 2:
        return 0
    diffs = {i: abs(2 * sum(lens[:i]) - sum(lens)) for i in range(1, len(lens))}
    best = min(diffs.values())
    first = min(i for i, d in diffs.items() if d == best)
    last = first
    while last + 1 in diffs and diffs[last + 1] == best:
        last += 1
    return last


def plan_reference(lens, threshold):
    """(split_seq, split_token, two_chunk) written from the rules, independently of plan.py."""
    total, b = sum(lens), balanced_reference(lens)
    left = sum(lens[:b])
    uneven = left < total * threshold or left > total * (1 - threshold)
    cum = [sum(lens[: i + 1]) for i in range(len(lens))]
    crossing = next((i for i, c in enumerate(cum) if c > total // 2), 0)
    if uneven and crossing + 1 <= total // 2:
        return crossing, total // 2, True
    return b, left, False


def plan(lens, mode=EXTEND, threshold=0.48):
    s = compute_split_seq_index(mode, sum(lens), lens, None, threshold=threshold)
    t = compute_split_token_index(s, mode, lens, None, threshold=threshold)
    return s, t, plan_extend_split(lens, threshold=threshold)[2]


@pytest.mark.parametrize(
    "lens, expected",
    [
        ([2, 2, 2, 2], (2, 4, False)),
        ([50, 1, 50], (2, 51, False)),  # tie |50-51| == |51-50|: the later cut wins
        ([1000, 10, 10], (0, 510, True)),  # one long prompt: two-chunk at total // 2
        ([10, 10, 1000], (2, 510, True)),
        ([1], (0, 0, False)),  # degenerate: A would get 1 seq and 0 tokens
        ([1, 2], (1, 1, False)),  # fallback: s + 1 = 2 > total // 2 = 1
        ([2], (0, 1, True)),
        ([], (0, 0, False)),
    ],
)
def test_sglang_extend_cases(lens, expected):
    assert plan(lens) == expected
    assert plan(lens, mode=ForwardMode.MIXED) == expected


def test_threshold_zero_disables_two_chunk():
    assert plan([1000, 10, 10], threshold=0.0) == (1, 1000, False)


def test_threshold_above_half_is_rejected():
    with pytest.raises(ValueError, match="threshold"):
        plan_extend_split([1, 2], threshold=0.6)
    with pytest.raises(ValueError, match="threshold"):
        compute_split_seq_index(EXTEND, 3, [1, 2], None, threshold=0.51)


def test_decode_verify_idle():
    assert compute_split_seq_index(ForwardMode.DECODE, 7, None, 1) == 3
    assert compute_split_token_index(3, ForwardMode.DECODE, None, 1) == 3
    assert compute_split_seq_index(ForwardMode.TARGET_VERIFY, 20, None, 4) == 2
    assert compute_split_token_index(2, ForwardMode.TARGET_VERIFY, None, 4) == 8
    for mode in (ForwardMode.IDLE, ForwardMode.PREBUILT):
        assert compute_split_seq_index(mode, 0, None, 0) == 0
        assert compute_split_token_index(0, mode, None, 0) == 0
    assert compute_split_seq_index(ForwardMode.DRAFT_EXTEND, 5, [5], None) is None


def test_token_num_per_seq_and_children_counts():
    class Spec:
        draft_token_num = 3

    assert get_token_num_per_seq(ForwardMode.TARGET_VERIFY, Spec()) == 3
    assert get_token_num_per_seq(ForwardMode.DECODE) == 1
    assert get_token_num_per_seq(ForwardMode.IDLE) == 0
    assert get_token_num_per_seq(EXTEND) is None
    assert compute_tbo_children_num_token_non_padded(5, 12) == (5, 7)
    assert compute_tbo_children_num_token_non_padded(5, 3) == (3, 0)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: compute_split_seq_index(EXTEND, 3, None, None), "extend_lens"),
        (lambda: compute_split_seq_index(EXTEND, 3, [4, -1], None), "negative"),
        (lambda: compute_split_seq_index(ForwardMode.DECODE, 5, None, None), "token_num_per_seq"),
        (lambda: compute_split_seq_index(ForwardMode.TARGET_VERIFY, 10, None, 4), "multiple"),
        (lambda: compute_split_seq_index(ForwardMode.IDLE, 2, None, 0), "num_tokens=2"),
        (lambda: compute_split_token_index(4, EXTEND, [1, 2], None), "split_seq_index=4"),
        (lambda: compute_split_token_index(0, ForwardMode.DRAFT_EXTEND, [1], None), "DRAFT"),
        (lambda: get_token_num_per_seq(ForwardMode.TARGET_VERIFY, None), "spec_info"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 300), max_size=12),
    st.sampled_from([0.0, 0.1, 0.3, 0.48, 0.5]),
)
def test_matches_reference(lens, threshold):
    s, t, two_chunk = plan(lens, threshold=threshold)
    assert (s, t, two_chunk) == plan_reference(lens, threshold)
    assert plan_extend_split(lens, threshold=threshold) == (s, t, two_chunk)
    assert 0 <= t <= sum(lens) and 0 <= s <= len(lens)
    if two_chunk:  # the cut lies strictly inside sequence s
        assert sum(lens[:s]) <= t < sum(lens[: s + 1])
        assert s + 1 <= t  # A has at least one token per sequence
