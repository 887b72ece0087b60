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
    if peer:
        updated = _raised(updated, "peer_capacity", updated.worst_peer_capacity, slot_alignment)
    if expert:
        worst = updated.worst_expert_capacity
        updated = _raised(updated, "expert_capacity", worst, slot_alignment)
    return updated


def _raised(dispatcher, field, worst, slot_alignment):
    current = getattr(dispatcher, field)
    if current >= worst:
        raise CapacityOverflowError(
            f"{field}={current} is already the worst case {worst} yet overflow was reported"
        )
    bigger = next_capacity_bucket(current, worst, slot_alignment)
    return dataclasses.replace(dispatcher, **{field: bigger})


def _describe(dispatcher, peer, expert, slot_alignment):
    parts = []
    if peer:
        worst = dispatcher.worst_peer_capacity
        nxt = next_capacity_bucket(dispatcher.peer_capacity, worst, slot_alignment)
        parts.append(
            f"{peer} assignments overflowed peer_capacity={dispatcher.peer_capacity}: raise "
            f"peer_capacity (next bucket {nxt}, worst case {worst})"
        )
    if expert:
        worst = dispatcher.worst_expert_capacity
        nxt = next_capacity_bucket(dispatcher.expert_capacity, worst, slot_alignment)
        parts.append(
            f"{expert} assignments overflowed expert_capacity={dispatcher.expert_capacity}: "
            f"raise expert_capacity (next bucket {nxt}, worst case {worst})"
        )
    return "; ".join(parts) + " (or create the dispatcher with a larger capacity_factor)"
