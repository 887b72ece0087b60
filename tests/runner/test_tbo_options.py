"""TboOptions: field checks, the switch's two readings, and the part processes must share."""

import dataclasses

import pytest

from jtbo.runner import tbo_options


def _timer(shape, use_tbo, run):
    return 1.0


@pytest.mark.parametrize(
    "switch, enabled, auto", [(False, False, False), (True, True, False), ("auto", True, True)]
)
def test_the_switch_reads_as_enabled_and_auto(switch, enabled, auto):
    options = tbo_options.TboOptions(enable_two_batch_overlap=switch)
    assert (options.enabled, options.auto) == (enabled, auto)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(enable_two_batch_overlap="on"), "True, False or 'auto', got 'on'"),
        (dict(tbo_token_distribution_threshold=0.6), "tbo_token_distribution_threshold"),
        (dict(tbo_child_buckets=0), "tbo_child_buckets=0 must be >= 1"),
        (dict(tbo_auto_trials=0), "tbo_auto_trials must be an int >= 1"),
        (dict(tbo_auto_margin=-0.1), "tbo_auto_margin must be in"),
        (dict(tbo_timer=_timer), "need enable_two_batch_overlap='auto', got False"),
        (dict(enable_two_batch_overlap=True, tbo_plan="p.json"), "got True"),
    ],
)  # fmt: skip
def test_bad_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        tbo_options.TboOptions(**fields)


def test_the_agreed_part_leaves_out_only_the_timer_and_the_plan_path():
    options = tbo_options.TboOptions(
        enable_two_batch_overlap="auto", tbo_token_distribution_threshold=0.2,
        tbo_issue_barriers=True, tbo_auto_trials=5, tbo_timer=_timer, tbo_plan="plan.json",
    )  # fmt: skip
    agreed = options.agreed_part()
    assert (agreed.tbo_timer, agreed.tbo_plan) == (None, None)
    kept = [f.name for f in dataclasses.fields(options) if f.name not in ("tbo_timer", "tbo_plan")]
    assert all(getattr(agreed, name) == getattr(options, name) for name in kept)
