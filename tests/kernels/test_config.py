"""CopyConfig validation and the alignment hint."""

import pytest

from jtbo import kernels


def test_align_is_gcd_of_row_and_vector():
    cfg = kernels.CopyConfig(vector_bytes=16)
    assert cfg.align(4096, 2) == 8  # bf16: 8 per 16-byte vector
    assert cfg.align(12, 2) == 4
    assert cfg.align(7, 4) == 1
    assert cfg.align(0, 4) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_elems", 100),
        ("block_elems", 8),
        ("num_warps", 3),
        ("vector_bytes", 32),
        ("xla_below_bytes", -1),
    ],
)
def test_bad_values_raise(field, value):
    with pytest.raises(ValueError, match=f"CopyConfig.{field}"):
        kernels.CopyConfig(**{field: value})
