"""StepPhases: the phases of a step's clock reads (from_clock), and their medians."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jtbo.runner import step_phases


def test_phases_of_a_step_that_ran_twice():
    # start 0, inputs done 1; run 1 returned at 3, checked at 6; run 2 returned 10, checked 15.
    phases = step_phases.from_clock([0.0, 1.0, 3.0, 6.0, 10.0, 15.0])
    assert phases == step_phases.StepPhases(inputs=1.0, dispatch=6.0, counts=8.0, runs=2)
    assert phases.total == 15.0  # the phases cover the whole call


@given(st.lists(st.floats(0.0, 1.0), min_size=3, max_size=9).filter(lambda g: len(g) % 2))
def test_phases_cover_every_gap_between_clock_reads(gaps):
    clock = list(itertools.accumulate(gaps, initial=0.0))  # start, inputs, two reads per run
    phases = step_phases.from_clock(clock)
    assert phases.runs == (len(clock) - 2) // 2
    assert phases.total == pytest.approx(clock[-1] - clock[0])


@pytest.mark.parametrize("reads", [0, 2, 3, 5])
def test_a_clock_without_whole_runs_is_refused(reads):
    with pytest.raises(ValueError, match="2 \\+ 2 \\* runs"):
        step_phases.from_clock([float(i) for i in range(reads)])


def test_median_phases_per_field_and_the_most_runs():
    steps = [
        step_phases.StepPhases(inputs=1.0, dispatch=5.0, counts=2.0, runs=1),
        step_phases.StepPhases(inputs=3.0, dispatch=4.0, counts=9.0, runs=2),
        step_phases.StepPhases(inputs=2.0, dispatch=6.0, counts=1.0, runs=1),
    ]
    median = step_phases.median_phases(steps)
    assert median == step_phases.StepPhases(inputs=2.0, dispatch=5.0, counts=2.0, runs=2)
    with pytest.raises(ValueError, match="at least one"):
        step_phases.median_phases([])
