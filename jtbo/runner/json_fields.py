"""Checked reads of the runner's JSON files' fields, with errors that name the field."""

import math
from collections.abc import Callable
from typing import Any


def field(
    kind: str, record: dict, name: str, where: str, expected: str, check: Callable[[Any], bool]
) -> Any:
    """``record[name]`` after its check.

    Args:
      kind: the file kind named in errors ("tbo_plan", ...).
      record: the JSON object holding the field.
      name: the field.
      where: the path to ``record`` in the file ("shapes[2]." or "").
      expected: what the field must be, for the error message.
      check: the test the value must pass.

    Raises:
      ValueError: the field is missing or fails ``check`` (names it, expected and found).
    """
    if name not in record:
        raise ValueError(f"{kind} field {where}{name!r}: missing (expected {expected})")
    value = record[name]
    if not check(value):
        raise ValueError(f"{kind} field {where}{name!r}: expected {expected}, found {value!r}")
    return value


def is_count(value: Any, minimum: int = 0) -> bool:
    """An int (not a bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
