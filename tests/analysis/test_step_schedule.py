"""The step model's timeline: the executor's stage order and exchanges beside compute."""

from jtbo.analysis import step_schedule

Op = step_schedule.Op


def test_rounds_follow_the_executor():
    a, b = [["a0"], ["a1"], ["a2"]], [["b0"], ["b1"], ["b2"]]
    order = [s[0] for s in step_schedule.rounds(a, b, 1)]
    assert order == ["a0", "a1", "b0", "a2", "b1", "b2"]


def test_an_exchange_hides_under_other_compute_and_slows_it():
    issue = [Op("dispatch_a", 1.0, issues="x", exchange_ms=4.0)]
    other = [Op("experts", 4.0)]
    wait = [Op("dispatch_b", 1.0, waits="x")]
    assert step_schedule.simulate([issue, other, wait]).total_ms == 6.0
    slowed = step_schedule.simulate([issue, other, wait], slowdown=2.0)
    assert slowed.total_ms == 8.0 and slowed.waited_ms == 0.0
    exposed = step_schedule.simulate([issue, wait])
    assert exposed.total_ms == 6.0 and exposed.waited_ms == 4.0
