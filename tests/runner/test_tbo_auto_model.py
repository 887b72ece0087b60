"""``tbo_auto_source="model"``: decisions from a predictor, nothing run."""

import pytest

from jtbo.runner import planning, tbo_auto, tbo_options


def _never():
    raise AssertionError("a model decision runs no program")


def test_model_source_decides_without_running():
    options = tbo_options.TboOptions(
        enable_two_batch_overlap="auto",
        tbo_auto_source="model",
        tbo_predictor=lambda shape: (10.0, 7.0 if shape.capacity > 64 else 12.0),
    )
    auto = tbo_auto.TboAuto(3, 0.02, options.tbo_timer)
    big = auto.decide(tbo_auto.TboShape(4096, planning.ForwardMode.EXTEND), _never, _never)
    small = auto.decide(tbo_auto.TboShape(8, planning.ForwardMode.DECODE), _never, _never)
    assert (big.use_tbo, big.source, small.use_tbo) == (True, "model", False)


def test_model_source_needs_a_predictor_and_auto():
    with pytest.raises(ValueError, match="tbo_predictor"):
        tbo_options.TboOptions(enable_two_batch_overlap="auto", tbo_auto_source="model")
    with pytest.raises(ValueError, match="tbo_auto_source"):
        tbo_options.TboOptions(enable_two_batch_overlap="auto", tbo_auto_source="guess")
