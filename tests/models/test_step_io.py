"""A served step's page writes, token sources and token outputs against numpy references."""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.models import sampler, step_io


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(0, 12))
def test_write_pages_matches_numpy_and_drops_marked_rows(seed, count):
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 100, (4, 16)).astype(np.int32)
    cells = rng.choice(4 * 16, size=count, replace=False)  # distinct (row, position) cells
    rows, positions = np.divmod(cells, 16)
    slots = rng.integers(1, 100, count)
    dropped = rng.random(count) < 0.3
    writes = np.zeros((3, 16), np.int32)
    writes[0] = step_io.DROPPED_ROW  # padding token rows
    writes[0, :count] = np.where(dropped, step_io.DROPPED_ROW, rows)
    writes[1, :count], writes[2, :count] = positions, slots
    want = table.copy()
    want[rows[~dropped], positions[~dropped]] = slots[~dropped]
    np.testing.assert_array_equal(jax.jit(step_io.write_pages)(table, writes), want)


def test_resolve_input_ids_reads_the_named_rows_of_the_last_steps_tokens():
    ids = np.array([5, 6, 7, 8], np.int32)
    source = np.array([-1, 2, 0, -1], np.int32)
    prev = np.array([40, 41, 42], np.int32)
    got = step_io.resolve_input_ids(ids, source, prev)
    np.testing.assert_array_equal(got, [5, 42, 40, 8])


def test_step_output_is_the_argmax_with_flags_and_logprobs_at_a_fixed_width():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 11)).astype(np.float32)
    logits[1, 4] = np.nan
    out = step_io.step_output(logits, None, step_io.SamplerKey(rows=5, logprobs=True))
    assert out["tokens"].shape == out["finite"].shape == out["logprobs"].shape == (5,)
    np.testing.assert_array_equal(np.asarray(out["tokens"])[[0, 2]], np.argmax(logits[[0, 2]], -1))
    np.testing.assert_array_equal(out["finite"], [True, False, True, True, True])
    shifted = logits[0].astype(np.float64) - logits[0].max()
    want = shifted[np.argmax(logits[0])] - np.log(np.exp(shifted).sum())
    np.testing.assert_allclose(out["logprobs"][0], want, rtol=1e-5)
    wide = step_io.step_output(np.tile(logits, (3, 1)), None, step_io.SamplerKey(rows=4))
    np.testing.assert_array_equal(wide["tokens"][3], np.argmax(logits[0]))  # rows cut at 4


def test_step_output_samples_with_the_rows_parameters():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 9)).astype(np.float32) * 2
    params = dict(
        temperature=np.float32([0.0, 0.7, 1.3, 0.0]), top_p=np.float32([1.0, 0.9, 1.0, 0.5]),
        seed=np.int32([1, 2, 3, 4]), request_index=np.int32([0, 1, 2, 3]),
        token_index=np.int32([5, 6, 7, 8]),
    )  # fmt: skip
    out = step_io.step_output(logits, params, step_io.SamplerKey(rows=4, greedy_only=False))
    uniforms = sampler.sampling_uniforms(params["seed"], params["request_index"],
                                         params["token_index"])  # fmt: skip
    want = sampler.sample_rows_reference(logits, params["temperature"], params["top_p"], uniforms)
    np.testing.assert_array_equal(out["tokens"], want)
