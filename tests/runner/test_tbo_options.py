"""TboOptions: field checks, the switch's two readings, and the part processes must share."""

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
