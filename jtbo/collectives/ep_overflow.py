"""What the host does when an EP step reports overflow.

Routing is data-dependent, so a step cannot know in advance whether its fixed capacities
suffice. Every step returns its dispatchers' ``overflow`` counts (``[..., 2]``: assignments
dropped for ``peer_capacity`` and for ``expert_capacity``, per device, layer and micro-batch;
the host sums them). A step with overflow is not a valid result. Two policies:

* ``"rerun"``: re-run the same step with the overflowed capacity raised to its next bucket
  (doubled, rounded to ``slot_alignment``, capped at the worst case, which cannot overflow),
  so the number of compiled variants stays logarithmic in the capacity range.
* ``"raise"``: raise ``CapacityOverflowError`` naming the capacity to raise and by how much
  it overflowed.
"""

import dataclasses

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
    counts = np.asarray(overflow, dtype=np.int64)
    if counts.ndim == 0 or counts.shape[-1] != 2:
        raise ValueError(f"overflow shape {counts.shape} must end in 2 (peer, expert)")
    totals = counts.reshape(-1, 2).sum(0)
    return int(totals[0]), int(totals[1])


def next_capacity_bucket(capacity: int, worst: int, slot_alignment: int = 8) -> int:
    """The next capacity bucket: double, rounded to ``slot_alignment``, at most ``worst``."""
    return min(worst, ep_config.round_up(2 * capacity, slot_alignment))


def resolve_overflow(
    dispatcher: ep_config.EpDispatcher,
    overflow,
    *,
    policy: str = "rerun",
    slot_alignment: int = 8,
) -> ep_config.EpDispatcher | None:
    """Applies the host policy to a step's overflow counts.

    Args:
      dispatcher: the dispatcher the step ran with.
      overflow: the step's ``[..., 2]`` overflow counts for this dispatcher.
      policy: "rerun" or "raise".
      slot_alignment: rounding of the next capacity bucket.

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
    updated = dispatcher
    for kind, count in (("peer", peer), ("expert", expert)):
        if count:
            updated = _raised(updated, kind, slot_alignment)
    return updated


def _raised(dispatcher, kind, slot_alignment):
    """``dispatcher`` with its ``{kind}_capacity`` raised to the next bucket."""
    field = f"{kind}_capacity"
    current, worst = getattr(dispatcher, field), getattr(dispatcher, f"worst_{kind}_capacity")
    if current >= worst:
        raise CapacityOverflowError(
            f"{field}={current} is already the worst case {worst} yet overflow was reported"
        )
    bigger = next_capacity_bucket(current, worst, slot_alignment)
    return dataclasses.replace(dispatcher, **{field: bigger})


def _overflow_line(dispatcher, kind, count, slot_alignment):
    """One capacity's part of the overflow message; ``kind`` is "peer" or "expert"."""
    current = getattr(dispatcher, f"{kind}_capacity")
    worst = getattr(dispatcher, f"worst_{kind}_capacity")
    nxt = next_capacity_bucket(current, worst, slot_alignment)
    return (
        f"{count} assignments overflowed {kind}_capacity={current}: raise {kind}_capacity "
        f"(next bucket {nxt}, worst case {worst})"
    )


def _describe(dispatcher, peer, expert, slot_alignment):
    counts = (("peer", peer), ("expert", expert))
    parts = [_overflow_line(dispatcher, k, n, slot_alignment) for k, n in counts if n]
    return "; ".join(parts) + " (or create the dispatcher with a larger capacity_factor)"
