"""The ``tbo_plan`` JSON file: an "auto" runner's TBO decisions, saved and loaded.

``ModelRunner.save_tbo_plan(path)`` writes every decision; ``ModelRunner(...,
tbo=TboOptions(enable_two_batch_overlap="auto", tbo_plan=path))`` loads them, so those shapes
run their recorded choice without timing (a production server times nothing). The format,
version 1::

    {"version": 1,
     "shapes": [{"bucket": 8, "mode": "DECODE", "choice": "plain",
                 "plain_ms": 8.78, "tbo_ms": 10.67, "margin": 0.02}, ...]}

``bucket`` is the step's token capacity per DP rank, ``mode`` the agreed TBO mode's name
(EXTEND, MIXED, DECODE, TARGET_VERIFY), ``choice`` "tbo" or "plain". The choice is what the
runner follows (edit it to force a shape); the times and the margin record why it was made.
Loading checks every field and names the first bad one with the expected and the found value.
"""

import json
import os
from typing import Any

from jtbo.runner import json_fields, planning, tbo_auto

VERSION = 1
CHOICES = {"plain": False, "tbo": True}
MODE_NAMES = tuple(mode.name for mode in planning.TBO_MODES)


def _is_time(value: Any) -> bool:
    return json_fields.is_number(value) and value >= 0


def _is_margin(value: Any) -> bool:
    return json_fields.is_number(value) and 0 <= value < 1


def _is_bucket(value: Any) -> bool:
    return json_fields.is_count(value, 1)


# Per shape field: (check, what is expected).
SHAPE_FIELDS = {
    "bucket": (_is_bucket, "an int >= 1"),
    "mode": (lambda value: value in MODE_NAMES, f"one of {list(MODE_NAMES)}"),
    "choice": (lambda value: value in CHOICES, f"one of {list(CHOICES)}"),
    "plain_ms": (_is_time, "a finite number >= 0"),
    "tbo_ms": (_is_time, "a finite number >= 0"),
    "margin": (_is_margin, "a number in [0, 1)"),
}


def to_json(decisions: list[tbo_auto.TboDecision]) -> dict:
    """The file's content for some decisions (see the module docstring)."""
    shapes = [
        dict(
            bucket=d.shape.capacity,
            mode=d.shape.mode.name,
            choice="tbo" if d.use_tbo else "plain",
            plain_ms=d.plain_ms,
            tbo_ms=d.tbo_ms,
            margin=d.margin,
        )  # fmt: skip
        for d in decisions
    ]
    return {"version": VERSION, "shapes": shapes}


def save(path: str | os.PathLike, decisions: list[tbo_auto.TboDecision]) -> None:
    """Writes decisions as a plan file.

    Args:
      path: the file to (over)write.
      decisions: from ``ModelRunner.tbo_decisions()``.
    """
    with open(path, "w") as file:
        json.dump(to_json(decisions), file, indent=1)
        file.write("\n")


def _field(record: dict, name: str, where: str, expected: str, check) -> Any:
    return json_fields.field("tbo_plan", record, name, where, expected, check)


def _decision(record: Any, index: int) -> tbo_auto.TboDecision:
    """One entry of ``shapes``, checked."""
    where = f"shapes[{index}]."
    if not isinstance(record, dict):
        raise ValueError(f"tbo_plan field 'shapes[{index}]': expected an object, found {record!r}")
    value = {name: _field(record, name, where, text, check)
             for name, (check, text) in SHAPE_FIELDS.items()}  # fmt: skip
    unknown = sorted(set(record) - set(SHAPE_FIELDS))
    if unknown:
        raise ValueError(f"tbo_plan field {where}{unknown[0]!r}: unexpected (expected only "
                         f"{list(SHAPE_FIELDS)})")  # fmt: skip
    shape = tbo_auto.TboShape(value["bucket"], planning.ForwardMode[value["mode"]])
    return tbo_auto.TboDecision(
        shape, CHOICES[value["choice"]], float(value["plain_ms"]), float(value["tbo_ms"]),
        float(value["margin"]), "plan",
    )  # fmt: skip


def from_json(content: Any) -> list[tbo_auto.TboDecision]:
    """The decisions of a parsed plan file.

    Args:
      content: the parsed JSON.

    Returns:
      One ``TboDecision`` (source "plan") per entry of ``shapes``.

    Raises:
      ValueError: names the first bad field and the expected and found values (not an object,
        a missing field, a wrong type, an unknown mode or choice, a negative time, an unknown
        version, a shape listed twice).
    """
    if not isinstance(content, dict):
        raise ValueError(f"tbo_plan: expected a JSON object, found {type(content).__name__}")
    _field(content, "version", "", str(VERSION), lambda v: v == VERSION and type(v) is int)
    shapes = _field(content, "shapes", "", "a list", lambda v: isinstance(v, list))
    decisions = [_decision(record, index) for index, record in enumerate(shapes)]
    seen = set()
    for index, decision in enumerate(decisions):
        if decision.shape in seen:
            raise ValueError(
                f"tbo_plan field 'shapes[{index}]': expected one entry per (bucket, mode), found "
                f"{decision.shape.describe()} again"
            )
        seen.add(decision.shape)
    return decisions


def load(path: str | os.PathLike) -> list[tbo_auto.TboDecision]:
    """Reads and checks a plan file.

    Args:
      path: a file written by ``save`` (or by hand in its format).

    Returns:
      Its decisions (source "plan").

    Raises:
      ValueError: not JSON, or a bad field (``from_json``); the message names the file.
      OSError: the file cannot be read.
    """
    with open(path) as file:
        text = file.read()
    try:
        content = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"tbo_plan {os.fspath(path)}: not JSON ({error})") from error
    try:
        return from_json(content)
    except ValueError as error:
        raise ValueError(f"{error} [in {os.fspath(path)}]") from error
