"""``enable_two_batch_overlap="auto"``: decisions from injected timings, exact results, plan files.

Timings are injected (``tbo_timer``), so every decision is deterministic on the CPU; the timer
still runs each program, so compiles and KV writes are those of a real auto runner.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import model as model_lib
from jtbo.runner import runner as runner_lib
from jtbo.runner import tbo_auto, tbo_options, tbo_plan_file
from tests.runner import helpers

ForwardMode = tbo_auto.ForwardMode
EXTEND_8 = tbo_auto.TboShape(8, ForwardMode.EXTEND)
DECODE_8 = tbo_auto.TboShape(8, ForwardMode.DECODE)


class FakeTimer:
    """Runs each program as asked and reports fixed milliseconds per (mode, TBO or not)."""

    def __init__(self, times: dict):
        self.times, self.calls = times, []

    def __call__(self, shape, use_tbo, run):
        self.calls.append((shape, use_tbo))
        run()
        return self.times[shape.mode, use_tbo]


def _never_called(shape, use_tbo, run):
    raise AssertionError(f"timed {shape} although the plan decides it")


@pytest.fixture(scope="module")
def model():
    # One dense and one MoE layer: the decisions and the exactness of trial runs do not
    # depend on the depth, and each of the programs compiled has fewer layers.
    config = helpers.TWO_LAYER_TINY
    return model_lib.MoEModel(config, rngs=nnx.Rngs(0))


def _runner(model, tbo, **kwargs):
    return runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(4, 2),
        tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo, **kwargs), max_total_tokens=64,
        max_running_requests=4, token_buckets=(8,), dtype=jnp.float32,
    )  # fmt: skip


def _serve(runner, seed=0, decodes=2):
    """An extend step (three busy ranks, one idle), then ``decodes`` decode steps."""
    rng = np.random.default_rng(seed)
    ranks = [helpers.Rank() for _ in range(4)]
    prompts = [{0: 5, 1: 3}, {0: 4}, None, {0: 2}]
    batches = [
        None if p is None else r.extend({row: rng.integers(0, 128, n).tolist()
                                         for row, n in p.items()})
        for r, p in zip(ranks, prompts, strict=True)
    ]  # fmt: skip
    outputs = [runner.forward(batches)]
    for _ in range(decodes):
        batches = [
            None if p is None else r.decode({row: int(rng.integers(128)) for row in p})
            for r, p in zip(ranks, prompts, strict=True)
        ]
        outputs.append(runner.forward(batches))
    return outputs


def _assert_same(outputs_a, outputs_b):
    for step_a, step_b in zip(outputs_a, outputs_b, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a, b)  # bit for bit


@pytest.mark.parametrize(
    "plain_ms, tbo_ms, margin, want",
    [
        (100.0, 75.0, 0.25, True),  # exactly on the margin: kept
        (100.0, 75.01, 0.25, False),  # just outside
        (10.0, 9.79, 0.02, True),  # just inside the default margin
        (10.0, 9.81, 0.02, False),  # faster, but by less than the margin
        (10.0, 10.0, 0.0, True),  # no margin: a tie keeps TBO
    ],
)
def test_tbo_is_kept_only_when_faster_by_the_margin(plain_ms, tbo_ms, margin, want):
    assert tbo_auto.choose_tbo(plain_ms, tbo_ms, margin) is want
    timer = FakeTimer({(ForwardMode.DECODE, False): plain_ms, (ForwardMode.DECODE, True): tbo_ms})
    auto = tbo_auto.TboAuto(trials=3, margin=margin, timer=timer)
    made = auto.decide(DECODE_8, lambda: None, lambda: None)
    assert made.use_tbo is want and (made.plain_ms, made.tbo_ms) == (plain_ms, tbo_ms)
    assert timer.calls == [(DECODE_8, False), (DECODE_8, True)] * 3  # turns, after warm-ups


def test_the_median_of_the_trials_counts():
    times = iter([10.0, 50.0, 11.0, 9.0, 12.0, 9.5])  # plain, tbo, plain, tbo, plain, tbo
    plain, tbo = tbo_auto.time_programs(
        DECODE_8, lambda: None, lambda: None, lambda *_: next(times), trials=3
    )
    assert (plain, tbo) == (11.0, 9.5)


def test_auto_runner_decides_per_shape_and_a_saved_plan_reproduces_it(model, tmp_path):
    # TBO wins extend by 20 %, loses decode: extend runs TBO, decode plain.
    timer = FakeTimer({
        (ForwardMode.EXTEND, False): 10.0, (ForwardMode.EXTEND, True): 8.0,
        (ForwardMode.DECODE, False): 4.0, (ForwardMode.DECODE, True): 5.0,
    })  # fmt: skip
    auto = _runner(model, "auto", tbo_timer=timer, tbo_auto_trials=2)
    got = _serve(auto, decodes=3)
    assert [(d.shape, d.use_tbo, d.source) for d in auto.tbo_decisions()] == [
        (EXTEND_8, True, "timed"), (DECODE_8, False, "timed"),
    ]  # fmt: skip
    assert len(timer.calls) == 2 * 2 * 2  # 2 shapes x 2 programs x 2 trials, then no timing
    assert (auto.num_steps, auto.num_tbo_steps) == (4, 1)  # trial runs are not steps
    assert auto.compile_count == 4  # the two programs of each shape, nothing else
    assert auto.tbo_summary() == (
        "TBO on 1 of 4 steps: extend bucket 8 TBO (TBO 0.80x plain), "
        "decode bucket 8 plain (TBO 1.25x plain)"
    )
    # A fixed TBO runner runs the extend step the same way; its logits are the same bits.
    _assert_same(got[:1], _serve(_runner(model, True), decodes=0))

    path = tmp_path / "plan.json"
    auto.save_tbo_plan(path)
    saved = json.loads(path.read_text())
    assert saved["version"] == 1 and saved["shapes"][1] == dict(
        bucket=8, mode="DECODE", choice="plain", plain_ms=4.0, tbo_ms=5.0, margin=0.02
    )
    planned = _runner(model, "auto", tbo_timer=_never_called, tbo_plan=path)
    assert [(d.shape, d.use_tbo, d.plain_ms, d.tbo_ms, d.source) for d in
            planned.tbo_decisions()] == [
        (d.shape, d.use_tbo, d.plain_ms, d.tbo_ms, "plan") for d in auto.tbo_decisions()
    ]  # fmt: skip
    # Without any trial run: the same logits and the same KV pools, bit for bit.
    _assert_same(_serve(planned, decodes=3), got)
    np.testing.assert_array_equal(np.asarray(planned.engine.k), np.asarray(auto.engine.k))
    np.testing.assert_array_equal(np.asarray(planned.engine.v), np.asarray(auto.engine.v))
    assert planned.num_tbo_steps == 1 and planned.compile_count == 2

    _serve(auto, seed=1, decodes=1)  # decided shapes: no timing, no compile
    assert auto.compile_count == 4 and len(timer.calls) == 8


def test_trial_runs_leave_the_logits_and_kv_cache_of_one_real_plain_step(model):
    # Plain wins: the last trial run is TBO's, and the real plain run must undo its writes.
    timer = FakeTimer({
        (mode, use_tbo): 2.0 if use_tbo else 1.0
        for mode in (ForwardMode.EXTEND, ForwardMode.DECODE) for use_tbo in (False, True)
    })  # fmt: skip
    auto, fixed = _runner(model, "auto", tbo_timer=timer), _runner(model, False)
    _assert_same(_serve(auto, seed=3), _serve(fixed, seed=3))  # every step a first or a later
    np.testing.assert_array_equal(np.asarray(auto.engine.k), np.asarray(fixed.engine.k))
    np.testing.assert_array_equal(np.asarray(auto.engine.v), np.asarray(fixed.engine.v))
    assert auto.num_tbo_steps == fixed.num_tbo_steps == 0 and auto.num_steps == 3


@pytest.mark.parametrize("value", ["on", "Auto", "true", 1, 0, None, 0.5])
def test_enable_two_batch_overlap_rejects_anything_but_true_false_auto(model, value):
    with pytest.raises(ValueError, match=f"True, False or 'auto', got {value!r}"):
        _runner(model, value)


def test_auto_options_need_auto_and_sane_settings(model, tmp_path):
    with pytest.raises(ValueError, match="need enable_two_batch_overlap='auto', got True"):
        _runner(model, True, tbo_plan=tmp_path / "plan.json")
    with pytest.raises(ValueError, match="tbo_auto_margin must be in"):
        _runner(model, "auto", tbo_auto_margin=1.0)
    with pytest.raises(ValueError, match="tbo_auto_trials must be an int >= 1"):
        _runner(model, "auto", tbo_auto_trials=0)


def _valid_plan() -> dict:
    decisions = [
        tbo_auto.TboDecision(EXTEND_8, True, 10.0, 8.5, 0.02, "timed"),
        tbo_auto.TboDecision(DECODE_8, False, 4.0, 5.0, 0.02, "timed"),
    ]
    return tbo_plan_file.to_json(decisions)


# (field, corrupt value, what the message says it expected)
CORRUPTIONS = [
    ("bucket", "8", "an int >= 1"), ("bucket", 0, "an int >= 1"), ("bucket", True, "an int"),
    ("mode", "PREFILL", "one of"), ("mode", "IDLE", "one of"), ("mode", 2, "one of"),
    ("choice", "yes", "one of"), ("choice", None, "one of"),
    ("plain_ms", -1.0, ">= 0"), ("plain_ms", "1", ">= 0"), ("tbo_ms", -0.5, ">= 0"),
    ("tbo_ms", [1.0], ">= 0"), ("margin", 1.5, "[0, 1)"), ("margin", -0.1, "[0, 1)"),
]  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 1), st.sampled_from(CORRUPTIONS + [(name, None, "missing") for name in
                                                      tbo_plan_file.SHAPE_FIELDS]),
)  # fmt: skip
def test_a_corrupt_shape_field_is_named_with_expected_and_found(index, corruption):
    name, value, expected = corruption
    content = _valid_plan()
    if expected == "missing":
        del content["shapes"][index][name]
    else:
        content["shapes"][index][name] = value
    with pytest.raises(ValueError) as raised:
        tbo_plan_file.from_json(content)
    message = str(raised.value)
    assert f"field shapes[{index}].{name!r}" in message and expected in message, message
    if expected != "missing":
        assert f"found {value!r}" in message, message


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(version=2), "field 'version': expected 1, found 2"),
        (lambda c: c.update(version="1"), "field 'version': expected 1, found '1'"),
        (lambda c: c.pop("version"), "field 'version': missing (expected 1)"),
        (lambda c: c.update(shapes={}), "field 'shapes': expected a list, found {}"),
        (lambda c: c["shapes"].append(c["shapes"][0]), "found extend bucket 8 again"),
        (lambda c: c["shapes"][0].update(extra=1), "shapes[0].'extra': unexpected"),
        (lambda c: c["shapes"].append(3), "field 'shapes[2]': expected an object, found 3"),
    ],
)
def test_a_bad_plan_file_names_the_field(model, tmp_path, change, message):
    content = _valid_plan()
    change(content)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as raised:
        _runner(model, "auto", tbo_plan=path)
    text = str(raised.value)
    assert text.startswith("tbo_plan ") and message in text and f"[in {path}]" in text, text


def test_a_plan_file_that_is_not_json_or_not_an_object_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        tbo_plan_file.load(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="expected a JSON object, found list"):
        tbo_plan_file.load(path)


def test_processes_agree_on_the_slowest_timing_of_each_program():
    # Alone, process 0 would keep TBO (9.0 <= 9.8) and process 1 would not (9.9 > 9.8).
    gathered = np.asarray([[10.0, 9.0], [9.5, 9.9]])
    plain, tbo = tbo_auto.agree_timings(gathered)
    assert (plain, tbo) == (10.0, 9.9)
    assert tbo_auto.choose_tbo(plain, tbo, 0.02) is False  # the same on every process
    np.testing.assert_array_equal(tbo_auto.gather_timings(10.0, 9.0), [[10.0, 9.0]])
    with pytest.raises(ValueError, match=r"\[processes, 2\]"):
        tbo_auto.agree_timings(np.zeros((2, 3)))


def test_summary_of_fixed_and_undecided_runners():
    assert tbo_auto.steps_summary(5, 2, True, ()) == (
        "TBO on 2 of 5 steps (enable_two_batch_overlap=True)"
    )
    assert "no TBO-able shape seen yet" in tbo_auto.steps_summary(0, 0, "auto", ())
