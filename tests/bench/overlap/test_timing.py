"""The balanced matmul count and the hidden fraction read off the three times."""

import pytest

from jtbo.bench import overlap


def test_balanced_matmul_count():
    assert overlap.balanced_matmuls_per_window(1e-3, 1e-4) == 10
    assert overlap.balanced_matmuls_per_window(1e-5, 1e-3) == 1
    with pytest.raises(ValueError, match="raise --matmul"):
        overlap.balanced_matmuls_per_window(1.0, 1e-6)


def test_hidden_fraction():
    assert overlap.hidden_fraction(2.0, 3.0, 3.0) == 1.0  # the comm fully hidden
    assert overlap.hidden_fraction(2.0, 3.0, 5.0) == 0.0  # serial
    assert overlap.hidden_fraction(2.0, 3.0, 6.0) < 0  # interference
    with pytest.raises(ValueError):
        overlap.hidden_fraction(0.0, 1.0, 1.0)
