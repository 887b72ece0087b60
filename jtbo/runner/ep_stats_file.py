"""The ``ep_routing_stats`` JSON file: measured EP peak loads, saved and loaded.

A runner records, for every dispatch size (token rows per device) it ran, the largest peak
loads its steps reported: the most assignments (or dedup rows) one peer and one local expert
were given in one dispatch (``ep_dispatch.DispatchState.peak_load``).
``ModelRunner.save_ep_routing_stats(path)`` writes them; ``ModelRunner(...,
ep_routing_stats=path)`` sizes the capacities of those sizes at ``ep_capacity_headroom`` times
the peaks instead of ``ep_capacity_factor`` times the balanced load, so the exchange moves
slots the routing fills rather than a guess (``ep_config.sized_from_peaks``). A step whose
routing exceeds them overflows as ever, and the overflow policy applies. The format, version 1::

    {"version": 1,
     "model": {"num_experts": 64, "top_k": 8, "ep_size": 2, "dedup": false},
     "peaks": [{"rows": 2048, "peer": 9120, "expert": 1430}, ...]}

``model`` says what the peaks were measured for; loading checks it against the runner's model
and layout (peaks of another expert count, top-k, EP size or row kind do not apply). Loading
checks every field and names the first bad one with the expected and the found value.
"""

import json
import os
from collections.abc import Mapping
from typing import Any

from jtbo.runner import json_fields

VERSION = 1
KIND = "ep_routing_stats"
Peaks = dict[int, tuple[int, int]]  # rows per device -> (peer, expert) peak load


def model_key(num_experts: int, top_k: int, ep_size: int, dedup: bool) -> dict:
    """The ``model`` object of a file measured for this model and layout."""
    return {"num_experts": num_experts, "top_k": top_k, "ep_size": ep_size, "dedup": dedup}


def to_json(model: Mapping[str, Any], peaks: Mapping[int, tuple[int, int]]) -> dict:
    """The file's content (see the module docstring)."""
    rows = [dict(rows=r, peer=p, expert=e) for r, (p, e) in sorted(peaks.items())]
    return {"version": VERSION, "model": dict(model), "peaks": rows}


def save(path: str | os.PathLike, model: Mapping[str, Any], peaks: Mapping) -> None:
    """Writes peak loads as a stats file.

    Args:
      path: the file to (over)write.
      model: ``model_key(...)`` of the runner that measured them.
      peaks: rows per device -> (peer, expert) peak load.
    """
    with open(path, "w") as file:
        json.dump(to_json(model, peaks), file, indent=1)
        file.write("\n")


def _entry(record: Any, index: int) -> tuple[int, tuple[int, int]]:
    where = f"peaks[{index}]."
    if not isinstance(record, dict):
        raise ValueError(f"{KIND} field 'peaks[{index}]': expected an object, found {record!r}")
    rows = json_fields.field(KIND, record, "rows", where, "an int >= 1",
                             lambda v: json_fields.is_count(v, 1))  # fmt: skip
    peer, expert = (
        json_fields.field(KIND, record, name, where, "an int >= 0", json_fields.is_count)
        for name in ("peer", "expert")
    )
    unknown = sorted(set(record) - {"rows", "peer", "expert"})
    if unknown:
        raise ValueError(f"{KIND} field {where}{unknown[0]!r}: unexpected")
    return rows, (peer, expert)


def from_json(content: Any, model: Mapping[str, Any]) -> Peaks:
    """The peaks of a parsed stats file measured for ``model``.

    Args:
      content: the parsed JSON.
      model: ``model_key(...)`` of the runner that will use them.

    Returns:
      Rows per device -> (peer, expert) peak load.

    Raises:
      ValueError: names the first bad field with the expected and found values (not an
        object, a missing field, a wrong type, an unknown version, a row count listed twice,
        or peaks measured for another model or layout).
    """
    if not isinstance(content, dict):
        raise ValueError(f"{KIND}: expected a JSON object, found {type(content).__name__}")
    json_fields.field(KIND, content, "version", "", str(VERSION),
                      lambda v: v == VERSION and type(v) is int)  # fmt: skip
    json_fields.field(KIND, content, "model", "", dict(model), lambda v: v == dict(model))
    records = json_fields.field(KIND, content, "peaks", "", "a list",
                                lambda v: isinstance(v, list))  # fmt: skip
    peaks: Peaks = {}
    for index, record in enumerate(records):
        rows, value = _entry(record, index)
        if rows in peaks:
            raise ValueError(f"{KIND} field 'peaks[{index}].rows': {rows} is listed twice")
        peaks[rows] = value
    return peaks


def load(path: str | os.PathLike, model: Mapping[str, Any]) -> Peaks:
    """Reads a stats file (``from_json``'s checks; the path is named in its errors)."""
    with open(path) as file:
        try:
            return from_json(json.load(file), model)
        except ValueError as error:
            raise ValueError(f"{os.fspath(path)}: {error}") from error
