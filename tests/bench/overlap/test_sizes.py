"""``--bytes`` as buffer rows."""

import pytest

from jtbo.bench import overlap


def test_bytes_not_divisible_by_the_devices_is_rejected_naming_the_values():
    with pytest.raises(ValueError, match=r"--bytes 3000 .* 3 devices .* 3072"):
        overlap.buffer_rows(3000, 3, 2)
    assert overlap.buffer_rows(3 * overlap.COLUMNS * 2 * 4, 3, 2) == 12
