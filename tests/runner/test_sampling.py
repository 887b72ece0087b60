"""Token choice: greedy, temperature + top-p against an independent float64 nucleus, and
sampling inside ``generate`` (reproducible per request, whatever the DP rank or pipelining)."""

import contextlib
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.models import sampler
from jtbo.runner import generate as generate_lib
from jtbo.runner import last_rows, sampling, token_step

VOCAB = 12
GRID = 4096


def _reference_nucleus(logits, temperature, top_p):
    # A token stays iff the tokens strictly more likely than it hold less than top_p.
    z = np.asarray(logits, np.float64) / temperature
    probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    keep = np.array([probs[probs > p].sum() < top_p for p in probs])
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def _draw(logits, temperature, top_p, uniforms):
    rows = np.broadcast_to(np.asarray(logits, np.float32), (len(uniforms), len(logits)))
    full = np.full(len(uniforms), temperature, np.float32)
    return np.asarray(
        sampler.sample_rows(rows, full, np.full_like(full, top_p), np.asarray(uniforms, np.float32))
    )


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.floats(0.2, 3.0),
    top_p=st.floats(0.05, 1.0),
)
def test_draws_over_a_uniform_grid_give_the_nucleus(seed, temperature, top_p):
    # Evenly spaced uniforms: each token's share of them is its nucleus probability, to within
    # one grid step per CDF boundary (and float32 rounding).
    logits = np.random.default_rng(seed).normal(size=VOCAB) * 3
    draws = _draw(logits, temperature, top_p, (np.arange(GRID) + 0.5) / GRID)
    shares = np.bincount(draws, minlength=VOCAB) / GRID
    np.testing.assert_allclose(shares, _reference_nucleus(logits, temperature, top_p), atol=3e-3)


def test_draws_follow_the_nucleus_distribution_and_the_seed():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    n = 20000
    uniforms = sampler.sampling_uniforms(
        np.full(n, 3, np.int32), np.zeros(n, np.int32), np.arange(n, dtype=np.int32)
    )
    draws = _draw(logits, 1.0, 0.8, np.asarray(uniforms))
    counts = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(counts, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0], atol=0.015)
    again = sampler.sampling_uniforms(
        np.full(50, 3, np.int32), np.zeros(50, np.int32), np.arange(50, dtype=np.int32)
    )
    assert _draw(logits, 1.0, 0.8, np.asarray(again)).tolist() == draws[:50].tolist()
    other = sampler.sampling_uniforms(
        np.full(50, 3, np.int32), np.ones(50, np.int32), np.arange(50, dtype=np.int32)
    )
    assert _draw(logits, 1.0, 0.8, np.asarray(other)).tolist() != draws[:50].tolist()


def test_greedy_is_the_argmax_and_bad_params_are_named():
    logits = np.random.default_rng(0).normal(size=VOCAB)
    assert _draw(logits, 0.0, 1.0, [0.3]).tolist() == [int(np.argmax(logits))]
    with pytest.raises(ValueError, match="temperature"):
        sampling.SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling.SamplingParams(temperature=1.0, top_p=0.0)


class _FakeRunner:
    """Logits that depend only on each row's token and position (so on the request alone);
    tokens drawn by the numpy reference sampler, as ``ModelRunner.dispatch`` / ``resolve``."""

    def __init__(self, dp_size):
        self.dp_size, self.max_running_requests, self.num_slots = dp_size, 4, 200
        self.max_total_tokens = self.max_context_len = 199
        self.config = types.SimpleNamespace(vocab_size=VOCAB)
        self.options = types.SimpleNamespace(token_buckets=(64,))
        self.local_dp_ranks, self.multiprocess = tuple(range(dp_size)), False

    def failure_phase(self, name, *, collective):
        return contextlib.nullcontext()

    def step_idle(self):
        return False  # one process: no other process's steps to take part in

    def dispatch(self, batches, *, sampling, token_sources, after, logprobs):
        out = []
        for i, (batch, params, sources) in enumerate(
            zip(batches, sampling, token_sources, strict=True)
        ):
            if batch is None:
                out.append(None)
                continue
            ids = np.asarray(batch.input_ids).copy()
            if sources is not None and (sources >= 0).any():  # the step before's device ids
                ids = np.where(sources >= 0, after.result[i].tokens[np.maximum(sources, 0)], ids)
            logits = self._logits(types.SimpleNamespace(input_ids=ids, positions=batch.positions))
            out.append(_sample(logits[last_rows.last_rows(batch)], params))
        return types.SimpleNamespace(result=out)

    def resolve(self, pending):
        return pending.result

    @staticmethod
    def _logits(batch):
        ids, pos = np.asarray(batch.input_ids), np.asarray(batch.positions)
        phase = (ids[:, None] * 7 + pos[:, None] * 3 + np.arange(VOCAB)[None]) % VOCAB
        return np.sin(phase.astype(np.float64)) * 2

    def tbo_summary(self):
        return ""


def _sample(rows, params: token_step.RowSampling | None) -> token_step.StepTokens:
    if params is None:
        return token_step.StepTokens(np.argmax(rows, axis=-1).astype(np.int32), None)
    uniforms = np.asarray(
        sampler.sampling_uniforms(params.seed, params.request_index, params.token_index)
    )
    tokens = sampler.sample_rows_reference(rows, params.temperature, params.top_p, uniforms)
    return token_step.StepTokens(np.asarray(tokens, np.int32), None)


def test_generate_samples_per_request_whatever_the_rank_and_pipelining():
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    params = sampling.SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    streamed = []
    runs = [
        generate_lib.generate(
            _FakeRunner(dp), prompts, max_new_tokens=6, sampling_params=params, progress=False,
            on_token=(lambda i, t: streamed.append((i, t))) if dp == 1 else None,
            pipeline=pipeline,
        )
        for dp, pipeline in ((1, True), (3, True), (2, False))
    ]  # fmt: skip
    tokens = [[r.token_ids for r in run] for run in runs]
    assert tokens[0] == tokens[1] == tokens[2]
    for index, prompt in enumerate(prompts):  # the same draws, by hand
        history = list(prompt)
        for made in range(6):
            row = _FakeRunner._logits(
                types.SimpleNamespace(input_ids=history[-1:], positions=[len(history) - 1])
            )
            one = token_step.RowSampling(
                np.float32([0.8]), np.float32([0.9]), np.int32([11]), np.int32([index]),
                np.int32([made]),
            )  # fmt: skip
            history.append(int(_sample(row, one).tokens[0]))
        assert tokens[0][index] == history[len(prompt) :]
        assert [t for i, t in streamed if i == index] == tokens[0][index]
    greedy = generate_lib.generate(_FakeRunner(2), prompts, max_new_tokens=6, progress=False)
    assert [r.token_ids for r in greedy] != tokens[0]
