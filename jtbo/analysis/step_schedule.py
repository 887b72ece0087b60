"""The step model's timeline: one compute stream and one link per GPU, operation by operation.

A step is a list of stages per micro-batch (the operation list cut at its yields). Every
operation has a compute time; an issuing operation (``*_a``) starts an exchange when its
compute ends, and the matching waiting operation (``*_b``) cannot start before that exchange
has ended. The GPU's compute is serialised on one stream in the executor's order: a plain step
runs its stages in order; a TBO step runs A's first ``delta`` stages alone, then one stage of A
and one of B per round, then B's last ``delta`` stages (``overlap.operations._rounds``).
Exchanges go through the GPU's link one at a time in issue order (both micro-batches share
it), each taking its fixed time. Compute that runs while an exchange is in flight is slowed by
the ``slowdown`` factor (the exchange shares the GPU's SMs or memory).

The simulation is exact for that model: compute and link are two resources, and every
operation's start is the max of its stream predecessor's end and (for a wait) its exchange's
end.
"""

import dataclasses
from collections.abc import Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of one micro-batch."""

    name: str  # the operation's name, e.g. "dispatch_a" (per-operation totals are by name)
    compute_ms: float  # its compute at full speed
    issues: str | None = None  # key of the exchange it starts when its compute ends
    waits: str | None = None  # key of the exchange it waits for before its compute
    exchange_ms: float = 0.0  # the started exchange's link time (issuing operations)


Stage = Sequence[Op]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """What one simulated step did."""

    total_ms: float  # from the first operation's start to the last one's end
    compute_ms: dict[str, float]  # per operation name: compute time, slowdown included
    exchange_ms: float  # link time of every exchange
    waited_ms: float  # compute-stream time spent waiting for exchanges


def rounds(stages_a: Sequence[Stage], stages_b: Sequence[Stage], delta: int) -> Iterator[Stage]:
    """The TBO executor's stage order: A alone for ``delta`` stages, then A and B in turns, then
    B alone (``overlap.operations._rounds``).

    Raises:
      ValueError: the micro-batches' stage counts differ or ``delta`` is out of range.
    """
    if len(stages_a) != len(stages_b) or not 0 <= delta <= len(stages_a):
        raise ValueError(f"stages {len(stages_a)} / {len(stages_b)}, delta {delta}")
    yield from stages_a[:delta]
    for index in range(len(stages_a) - delta):
        yield stages_a[index + delta]
        yield stages_b[index]
    yield from stages_b[len(stages_b) - delta :]


def _run_compute(start: float, work: float, busy: list[tuple[float, float]], slowdown: float):
    """End time of ``work`` ms of compute started at ``start``, slowed inside busy intervals."""
    now, left = start, work
    for low, high in busy:
        if high <= now:
            continue
        if low > now:
            if left <= low - now:
                return now + left
            left -= low - now
            now = low
        if left * slowdown <= high - now:
            return now + left * slowdown
        left -= (high - now) / slowdown
        now = high
    return now + left


def simulate(order: Sequence[Stage], slowdown: float = 1.0) -> Timeline:
    """Runs the stages in ``order`` on one compute stream and one link (module docstring).

    Args:
      order: the stages as the executor runs them; exchange keys must be unique per
        micro-batch (e.g. prefixed by it).
      slowdown: compute time inside an exchange over compute time alone (>= 1).

    Returns:
      The step's ``Timeline``.

    Raises:
      ValueError: an operation waits for an exchange not yet issued.
    """
    now = link_free = waited = exchange = 0.0
    busy: list[tuple[float, float]] = []
    ends: dict[str, float] = {}
    compute: dict[str, float] = {}
    for op in (op for stage in order for op in stage):
        if op.waits is not None:
            if op.waits not in ends:
                raise ValueError(f"{op.name} waits for {op.waits}, which was never issued")
            waited += max(0.0, ends[op.waits] - now)
            now = max(now, ends.pop(op.waits))
        end = _run_compute(now, op.compute_ms, busy, slowdown)
        compute[op.name] = compute.get(op.name, 0.0) + end - now
        now = end
        if op.issues is not None:
            start = max(now, link_free)
            link_free = start + op.exchange_ms
            exchange += op.exchange_ms
            if op.exchange_ms > 0:
                busy.append((start, link_free))
            ends[op.issues] = link_free
    return Timeline(max(now, link_free), compute, exchange, waited)
