"""What the host does when an EP step reports overflow.

Routing is data-dependent, so a step cannot know in advance whether its fixed capacities
suffice. Every step returns its dispatchers' ``overflow`` counts (``[..., 2]``: assignments
dropped for ``peer_capacity`` and for ``expert_capacity``, per device, layer and micro-batch;
the host sums them; with ``EpDispatcher.dedup`` the peer count is of (token, device) rows).
A step with overflow is not a valid result. Two policies:

* ``"rerun"``: re-run the same step with the overflowed capacity raised to its next bucket,
  capped at the worst case (which cannot overflow) and rounded to ``slot_alignment``. When the
  step also reports its *peak load* (the most assignments one peer / one local expert was
  given, max over devices and layers: ``ep_dispatch.DispatchState.peak_load``), the bucket is
  the peak itself, but at least ``MIN_GROWTH`` times the old capacity, so that a run of
  slightly growing peaks cannot recompile at every step; without it, the capacity doubles.
  Either way the number of compiled variants stays logarithmic in the capacity range. Sizing
  on the peak matters for two-batch overlap: a micro-batch routes half the tokens, so its
  load is relatively more uneven than the whole batch's. Measured on one H200 with
  ``MoEConfig.deepseek_v3_gqa_reduced()`` (random weights, capacity factor 4), decode 128: the
  plain step's 64 expert slots held, each TBO micro-batch's 33 overflowed, and doubling to 66
  gave the merged expert matmuls 132 rows against the plain step's 64.
* ``"raise"``: raise ``CapacityOverflowError`` naming the capacity to raise and by how much
  it overflowed.
"""

import dataclasses
import math

import numpy as np

from jtbo.collectives import ep_config

POLICIES = ("rerun", "raise")


class CapacityOverflowError(RuntimeError):
    """Routed assignments did not fit the dispatcher's capacities."""


def total_overflow(overflow) -> tuple[int, int]:
    """Sums overflow counts of any leading shape into ``(peer, expert)``.

    Args:
      overflow: array-like ``[..., 2]`` of per-device (peer, expert) counts.

    Returns:
      ``(peer_overflow, expert_overflow)`` totals.

    Raises:
      ValueError: the last axis is not 2.
    """
    totals = _pairs(overflow, "overflow").sum(0)
    return int(totals[0]), int(totals[1])


MIN_GROWTH = 1.25
"""Smallest factor a re-run raises a capacity by when the step reported its peak load."""


def _pairs(values, name: str) -> np.ndarray:
    """``[..., 2]`` (peer, expert) values as ``[n, 2]`` int64; ``name`` is for the error."""
    array = np.asarray(values, dtype=np.int64)
    if array.ndim == 0 or array.shape[-1] != 2:
        raise ValueError(f"{name} shape {array.shape} must end in 2 (peer, expert)")
    return array.reshape(-1, 2)


def next_capacity_bucket(
    capacity: int, worst: int, slot_alignment: int = 8, peak: int | None = None
) -> int:
    """The next capacity bucket, rounded to ``slot_alignment`` and at most ``worst``.

    Args:
      capacity: the capacity that overflowed.
      worst: the worst-case capacity (cannot overflow).
      slot_alignment: rounding.
      peak: the load the step needed, or None (unknown: double).

    Returns:
      ``max(peak, MIN_GROWTH * capacity)`` with a peak, else ``2 * capacity``; rounded up.
    """
    target = 2 * capacity if peak is None else max(peak, math.ceil(MIN_GROWTH * capacity))
    return min(worst, ep_config.round_up(target, slot_alignment))


def resolve_overflow(
    dispatcher: ep_config.EpDispatcher,
    overflow,
    *,
    policy: str = "rerun",
    slot_alignment: int = 8,
    peak_load=None,
) -> ep_config.EpDispatcher | None:
    """Applies the host policy to a step's overflow counts.

    Args:
      dispatcher: the dispatcher the step ran with.
      overflow: the step's ``[..., 2]`` overflow counts for this dispatcher.
      policy: "rerun" or "raise".
      slot_alignment: rounding of the next capacity bucket.
      peak_load: the step's ``[..., 2]`` (peer, expert) peak loads for this dispatcher (the
        max is taken), or None; sizes the re-run's capacities (``next_capacity_bucket``).

    Returns:
      None when nothing overflowed (the step's result stands); under "rerun", the dispatcher to
      re-run the step with.

    Raises:
      CapacityOverflowError: under "raise" when anything overflowed, or when a capacity already
        at its worst case reports overflow (inconsistent counts).
      ValueError: an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
    peer, expert = total_overflow(overflow)
    if peer == 0 and expert == 0:
        return None
    if policy == "raise":
        raise CapacityOverflowError(_describe(dispatcher, peer, expert, slot_alignment))
    peaks = (None, None) if peak_load is None else _max_peaks(peak_load)
    updated = dispatcher
    for kind, count, peak in (("peer", peer, peaks[0]), ("expert", expert, peaks[1])):
        if count:
            updated = _raised(updated, kind, slot_alignment, peak)
    return updated


def _max_peaks(peak_load) -> tuple[int, int]:
    """``(peer, expert)`` maxima of ``[..., 2]`` peak loads."""
    maxima = _pairs(peak_load, "peak_load").max(0, initial=0)
    return int(maxima[0]), int(maxima[1])


def _raised(dispatcher, kind, slot_alignment, peak):
    """``dispatcher`` with its ``{kind}_capacity`` raised to the next bucket."""
    field = f"{kind}_capacity"
    current, worst = getattr(dispatcher, field), getattr(dispatcher, f"worst_{kind}_capacity")
    if current >= worst:
        raise CapacityOverflowError(
            f"{field}={current} is already the worst case {worst} yet overflow was reported"
        )
    bigger = next_capacity_bucket(current, worst, slot_alignment, peak)
    return dataclasses.replace(dispatcher, **{field: bigger})


def _overflow_line(dispatcher, kind, count, slot_alignment):
    """One capacity's part of the overflow message; ``kind`` is "peer" or "expert"."""
    current = getattr(dispatcher, f"{kind}_capacity")
    worst = getattr(dispatcher, f"worst_{kind}_capacity")
    nxt = next_capacity_bucket(current, worst, slot_alignment)
    what = "(token, device) rows" if dispatcher.dedup and kind == "peer" else "assignments"
    return (
        f"{count} {what} overflowed {kind}_capacity={current}: raise {kind}_capacity "
        f"(next bucket {nxt}, worst case {worst})"
    )


def _describe(dispatcher, peer, expert, slot_alignment):
    counts = (("peer", peer), ("expert", expert))
    parts = [_overflow_line(dispatcher, k, n, slot_alignment) for k, n in counts if n]
    return "; ".join(parts) + " (or create the dispatcher with a larger capacity_factor)"
