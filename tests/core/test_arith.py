"""ceil_div / round_up / power_of_two_at_least against Python's exact integer arithmetic."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.core import arith

_INTS = st.integers(-(10**30), 10**30)
_POSITIVE = st.integers(1, 10**12)


def _exact_ceil(a: int, b: int) -> int:
    q, r = divmod(a, b)
    return q + (r != 0)


@settings(max_examples=300, deadline=None)
@given(a=_INTS, b=_POSITIVE)
def test_ceil_div_matches_exact_ceiling(a, b):
    assert arith.ceil_div(a, b) == _exact_ceil(a, b)
    if abs(a) < 2**52:  # exact in float64
        assert arith.ceil_div(a, b) == math.ceil(a / b)


@settings(max_examples=300, deadline=None)
@given(a=_INTS, m=_POSITIVE)
def test_round_up_is_the_smallest_multiple_not_below(a, m):
    r = arith.round_up(a, m)
    assert r % m == 0 and r >= a and r - m < a


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=20),
    b=st.integers(1, 4096),
)
def test_numpy_arrays_elementwise(values, b):
    a = np.asarray(values, np.int64)
    np.testing.assert_array_equal(arith.ceil_div(a, b), [_exact_ceil(v, b) for v in values])
    np.testing.assert_array_equal(arith.round_up(a, b), [_exact_ceil(v, b) * b for v in values])


def test_small_cases():
    assert [arith.ceil_div(a, 4) for a in range(0, 9)] == [0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert [arith.round_up(a, 4) for a in range(0, 9)] == [0, 4, 4, 4, 4, 8, 8, 8, 8]


@settings(max_examples=300, deadline=None)
@given(value=st.integers(-100, 2**40), floor_log2=st.integers(0, 8))
def test_power_of_two_at_least_is_the_smallest_one_not_below(value, floor_log2):
    floor = 2**floor_log2
    got = arith.power_of_two_at_least(value, floor)
    powers = [2**k for k in range(floor_log2, 42) if 2**k >= value]
    assert got == powers[0]
