"""Host time of the phases of one ``ModelRunner.run_plan``: where a step's wall time goes.

A step's wall time is host work before the devices start (packing the plan, with its page-table
writes, and issuing its two transfers, then the jitted call, which returns once the program is
enqueued), the devices' work, and the read-back of the EP overflow counts and peak loads that
the host needs before it may accept the step (an overflowing step re-runs with the next
capacity bucket, so the phases are summed over its runs). The runner reads the host clock at
each boundary (``time.perf_counter``: two reads before the first run, two per run), turns
the reads into the last step's ``StepPhases`` (``from_clock``) and keeps them;
``python -m jtbo.bench tbo`` prints their medians per case.
"""

import dataclasses
import statistics
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class StepPhases:
    """Host seconds of one step's phases.

    Attributes:
      inputs: before the first jitted call: packing the plan (its page-table writes included)
        and issuing its host->device transfers.
      dispatch: inside the jitted calls, until each returned (the program enqueued; summed
        over EP re-runs).
      counts: from each call's return until its EP overflow counts and peak loads were on the
        host and checked: the devices' remaining work plus the read-back (summed over re-runs;
        about zero without EP, where nothing is read back).
      runs: how many times the program ran (1, plus one per EP re-run).
    """

    inputs: float
    dispatch: float
    counts: float
    runs: int

    @property
    def total(self) -> float:
        """Seconds of all three phases."""
        return self.inputs + self.dispatch + self.counts


def from_clock(clock: Sequence[float]) -> StepPhases:
    """The phases of one step's clock reads.

    Args:
      clock: host seconds at the step's start, once its inputs were issued, then per run of
        the program two reads: when the jitted call returned and when its EP counts were
        checked.

    Returns:
      The ``StepPhases`` (a re-run starts once the run before it was checked).

    Raises:
      ValueError: not two reads before the runs and two per run, at least one run.
    """
    if len(clock) < 4 or len(clock) % 2:
        raise ValueError(f"a step's clock holds 2 + 2 * runs reads (runs >= 1), got {len(clock)}")
    returns, checks = clock[2::2], clock[3::2]
    begins = [clock[1], *checks[:-1]]
    return StepPhases(
        inputs=clock[1] - clock[0],
        dispatch=sum(end - begin for begin, end in zip(begins, returns, strict=True)),
        counts=sum(end - begin for begin, end in zip(returns, checks, strict=True)),
        runs=len(returns),
    )


def median_phases(phases: Sequence[StepPhases]) -> StepPhases:
    """Each field's median over several steps (``runs``: the largest).

    Raises:
      ValueError: no steps.
    """
    if not phases:
        raise ValueError("median_phases needs at least one step")
    return StepPhases(
        inputs=statistics.median(p.inputs for p in phases),
        dispatch=statistics.median(p.dispatch for p in phases),
        counts=statistics.median(p.counts for p in phases),
        runs=max(p.runs for p in phases),
    )
