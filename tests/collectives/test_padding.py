"""SGLang's DP padding-mode rule."""

import pytest

from jtbo.collectives import padding

MAX, SUM = padding.DpPaddingMode.MAX_LEN, padding.DpPaddingMode.SUM_LEN


@pytest.mark.parametrize(
    "is_extend, counts, want",
    [
        (True, [5, 0, 7, 1], SUM),  # extend with dp > 1: always SUM_LEN
        (True, [9], MAX),  # dp == 1: max == sum, MAX_LEN
        (False, [4, 4, 4, 4], MAX),  # even: sum*2 = 32 >= max*dp = 16
        (False, [8, 0, 0, 0], SUM),  # sum*2 = 16 < 32
        (False, [8, 8, 0, 0], MAX),  # tie 32 == 32 goes to MAX_LEN
        (False, [8, 7, 0, 0], SUM),  # 30 < 32
        (False, [0, 0], MAX),  # all idle: 0 >= 0
    ],
)
def test_selection_rule(is_extend, counts, want):
    assert padding.select_dp_padding_mode(is_extend, counts) is want


def test_mode_predicates():
    assert MAX.is_max_len() and not MAX.is_sum_len() and SUM.is_sum_len()
    assert not SUM.is_max_len()


@pytest.mark.parametrize("counts", [[], [3, -1]])
def test_bad_counts(counts):
    with pytest.raises(ValueError, match="global_num_tokens"):
        padding.select_dp_padding_mode(False, counts)
