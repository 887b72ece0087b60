"""Fuzzing ``ModelRunner.forward`` with malformed batches: each is refused before device work.

Every example takes a good two-request EXTEND batch and breaks it one way (lengths that
disagree, indices out of range, negative values, NaN/inf in spec-decoding fields, wrong
dtypes, an ``out_cache_loc`` overlapping another request's, verify sizes that do not divide,
an empty batch on a rank that says EXTEND). Building and forwarding it must raise a
``ValueError`` naming the field and the numbers, with no call of the jitted step; then a good
batch must give the same logits as on a fresh runner. ``make test`` runs ``FUZZ_EXAMPLES``;
``pytest --hypothesis-profile=long`` many more (tests/conftest.py).
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import split
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import model as model_lib
from jtbo.runner import runner as runner_lib

FUZZ_EXAMPLES = max(300, settings.default.max_examples)
MAX_TOKENS, MAX_REQS, VOCAB = 32, 4, 128
EXTEND, VERIFY = split.ForwardMode.EXTEND, split.ForwardMode.TARGET_VERIFY


class _CountingStep:
    """The runner's jitted step, counting calls (a refused batch must make none)."""

    def __init__(self, step):
        self._step, self.calls = step, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._step, name)


def _make_runner():
    model = model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(0))
    return runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(1, 1), max_total_tokens=MAX_TOKENS,
        max_running_requests=MAX_REQS, token_buckets=(16,), dtype=jnp.float32,
    )  # fmt: skip


def _good_fields(lens=(3, 4)):
    n = sum(lens)
    return dict(
        forward_mode=EXTEND, batch_size=len(lens), input_ids=np.arange(5, 5 + n) % VOCAB,
        positions=np.concatenate([np.arange(k) for k in lens]),
        out_cache_loc=np.arange(1, n + 1), req_pool_indices=np.arange(len(lens)),
        seq_lens=np.asarray(lens), extend_seq_lens=np.asarray(lens),
        extend_prefix_lens=np.zeros(len(lens), np.int64),
    )  # fmt: skip


def _verify_fields(draft, batch_size, **spec_changes):
    n = draft * batch_size
    spec = dict(
        draft_token=np.ones(n, np.int64), positions=np.arange(n),
        custom_mask=np.ones(batch_size * draft * draft, bool), seq_lens=np.zeros(batch_size, int),
        draft_token_num=draft,
    )  # fmt: skip
    spec.update(spec_changes)
    return dict(
        forward_mode=VERIFY, batch_size=batch_size, input_ids=np.ones(n, np.int64),
        positions=np.arange(n), out_cache_loc=np.arange(1, n + 1),
        req_pool_indices=np.arange(batch_size), seq_lens=np.zeros(batch_size, np.int64),
        spec_info=split.SpecVerifyInput(**spec),
    )  # fmt: skip


@st.composite
def flaws(draw):
    """(a function building the bad batch's fields, a regex its error must match)."""
    kind = draw(st.sampled_from(FLAWS))
    return kind(draw)


def _lengths(draw):
    extra = draw(st.integers(1, 5))
    fields = _good_fields()
    fields["extend_seq_lens"] = fields["extend_seq_lens"] + np.array([extra, 0])
    fields["seq_lens"] = fields["extend_seq_lens"]
    return lambda: fields, rf"sum\(extend_seq_lens\)={7 + extra} != 7"


def _rows_disagree(draw):
    cut = draw(st.integers(1, 6))
    field = draw(st.sampled_from(["positions", "out_cache_loc"]))
    fields = _good_fields()
    fields[field] = fields[field][:-cut]
    return lambda: fields, rf"{field} has {7 - cut} rows, expected 7"


def _index_out_of_range(draw):
    field = draw(st.sampled_from(["req_pool_indices", "out_cache_loc", "input_ids", "positions"]))
    sign = draw(st.sampled_from([1, -1]))
    fields = _good_fields()
    value = fields[field].copy()
    top = {"req_pool_indices": MAX_REQS, "out_cache_loc": MAX_TOKENS + 1, "input_ids": VOCAB,
           "positions": MAX_TOKENS}[field]  # fmt: skip
    bad = top + draw(st.integers(0, 1000)) if sign > 0 else -draw(st.integers(1, 1000))
    value[-1] = bad
    fields[field] = value
    name = {"input_ids": "token ids", "req_pool_indices": "req_pool_indices"}.get(field, field)
    return lambda: fields, rf"{name} (span|range) \[.*{bad}"


def _negative_length(draw):
    field = draw(st.sampled_from(["extend_prefix_lens", "seq_lens", "extend_seq_lens"]))
    low = -draw(st.integers(1, 50))
    fields = _good_fields()
    fields[field] = np.array([low, fields[field][1]])
    return lambda: fields, rf"{field} has a negative length: min {low}"


def _non_finite_spec(draw):
    field = draw(st.sampled_from(["draft_token", "positions", "custom_mask", "seq_lens"]))
    value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    fields = _verify_fields(2, 2)
    spec = fields["spec_info"]

    def build():
        array = np.asarray(getattr(spec, field), np.float64).copy()
        array[draw_index % array.size] = value
        changes = {f: getattr(spec, f) for f in ("draft_token", "positions", "custom_mask",
                                                  "seq_lens")}  # fmt: skip
        changes[field] = array
        return {**fields, "spec_info": split.SpecVerifyInput(draft_token_num=2, **changes)}

    draw_index = draw(st.integers(0, 7))
    return build, rf"spec_info\.{field} has dtype float64.*non-finite value {value}"


def _wrong_dtype(draw):
    field = draw(st.sampled_from(["input_ids", "positions", "out_cache_loc", "req_pool_indices",
                                  "seq_lens", "extend_seq_lens"]))  # fmt: skip
    dtype = draw(st.sampled_from([np.float32, np.float64, np.complex64]))
    fields = _good_fields()
    fields[field] = fields[field].astype(dtype)
    return lambda: fields, rf"ForwardBatch\.{field} has dtype {np.dtype(dtype).name}"


def _overlapping_slots(draw):
    first = draw(st.integers(0, 2))  # a token of request 0
    second = draw(st.integers(3, 6))  # a token of request 1
    fields = _good_fields()
    slots = fields["out_cache_loc"].copy()
    slots[second] = slots[first]
    fields["out_cache_loc"] = slots
    return lambda: fields, rf"out_cache_loc gives slot {slots[first]} to token rows {first} and "


def _verify_not_divisible(draw):
    draft = draw(st.integers(2, 4))
    extra = draw(st.integers(1, draft - 1))
    fields = _verify_fields(draft, 2)
    n = 2 * draft + extra
    fields.update(input_ids=np.ones(n, np.int64), positions=np.arange(n))
    fields["out_cache_loc"] = np.arange(1, n + 1)
    return (
        lambda: fields,
        rf"len\(input_ids\) == batch_size \* draft_token_num, got {2 * draft + extra}",
    )


def _empty_extend(draw):
    fields = dict(forward_mode=EXTEND, batch_size=0, input_ids=np.zeros(0, np.int32))
    return lambda: fields, r"EXTEND batch with no work \(batch_size=0, len\(input_ids\)=0\)"


FLAWS = (
    _lengths, _rows_disagree, _index_out_of_range, _negative_length, _non_finite_spec,
    _wrong_dtype, _overlapping_slots, _verify_not_divisible, _empty_extend,
)  # fmt: skip


@pytest.fixture(scope="module")
def runners():
    """(the fuzzed runner with its counting step, the good batch's logits on a fresh runner)."""
    fresh = _make_runner()
    want = fresh.forward([split.ForwardBatch(**_good_fields())])[0]
    runner = _make_runner()
    runner.engine.step = _CountingStep(runner.engine.step)
    return runner, want


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(flaw=flaws())
def test_a_malformed_batch_is_refused_before_device_work(runners, flaw):
    runner, want = runners
    build, message = flaw
    calls = runner.engine.step.calls
    with pytest.raises(ValueError) as error:
        runner.forward([split.ForwardBatch(**build())])
    assert re.search(message, str(error.value)), (message, str(error.value))
    assert runner.engine.step.calls == calls  # no device step ran


def test_the_runner_serves_a_good_batch_after_the_refusals(runners):
    runner, want = runners
    got = runner.forward([split.ForwardBatch(**_good_fields())])[0]
    np.testing.assert_array_equal(got, want)
