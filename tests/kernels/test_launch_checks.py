"""The launch configs' shared field checks."""

import dataclasses

import pytest

from jtbo.kernels import launch_checks


@dataclasses.dataclass
class _Knobs:
    block: int
    stages: int


def test_is_power_of_two_against_a_set():
    powers = {2**i for i in range(20)}
    for value in range(-4, 1 << 12):
        assert launch_checks.is_power_of_two(value) == (value in powers), value


def test_checks_name_the_class_field_and_value():
    launch_checks.require_powers_of_two(_Knobs(64, 3), ("block",))
    launch_checks.require_at_least(_Knobs(64, 3), ("block", "stages"), 3)
    with pytest.raises(ValueError, match=r"_Knobs\.block must be a power of two, got 48"):
        launch_checks.require_powers_of_two(_Knobs(48, 3), ("block",))
    with pytest.raises(ValueError, match=r"_Knobs\.stages must be >= 4, got 3"):
        launch_checks.require_at_least(_Knobs(64, 3), ("block", "stages"), 4)
