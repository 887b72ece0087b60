"""Token choice: greedy, temperature + top-p against independent float64 references, and
sampling inside ``generate`` (reproducible per request, whatever the DP rank)."""

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.runner import generate as generate_lib
from jtbo.runner import last_rows, sampling

VOCAB = 12


def _reference_nucleus(logits, temperature, top_p):
    # A token stays iff the tokens strictly more likely than it hold less than top_p.
    z = np.asarray(logits, np.float64) / temperature
    probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    keep = np.array([probs[probs > p].sum() < top_p for p in probs])
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.floats(0.2, 3.0),
    top_p=st.floats(0.05, 1.0),
)
def test_nucleus_matches_the_reference(seed, temperature, top_p):
    logits = np.random.default_rng(seed).normal(size=VOCAB) * 3
    got = sampling.nucleus_probs(logits, temperature, top_p)
    np.testing.assert_allclose(got, _reference_nucleus(logits, temperature, top_p), atol=1e-12)


def test_draws_follow_the_nucleus_distribution_and_the_seed():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    params = sampling.SamplingParams(temperature=1.0, top_p=0.8, seed=3)
    generator = sampling.request_generator(params, 0)
    draws = np.array([sampling.next_token(logits, params, generator) for _ in range(20000)])
    counts = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(counts, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0], atol=0.015)
    again = sampling.request_generator(params, 0)
    first = [sampling.next_token(logits, params, again) for _ in range(50)]
    assert first == draws[:50].tolist()
    other = sampling.request_generator(params, 1)
    assert [sampling.next_token(logits, params, other) for _ in range(50)] != first


def test_greedy_is_the_argmax_and_bad_params_are_named():
    logits = np.random.default_rng(0).normal(size=VOCAB)
    assert sampling.next_token(logits, sampling.GREEDY, None) == int(np.argmax(logits))
    with pytest.raises(ValueError, match="temperature"):
        sampling.SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        sampling.SamplingParams(temperature=1.0, top_p=0.0)


class _FakeRunner:
    """Logits that depend only on each row's token and position (so on the request alone)."""

    def __init__(self, dp_size):
        self.dp_size, self.max_running_requests, self.num_slots = dp_size, 4, 200
        self.max_total_tokens = 199
        self.config = types.SimpleNamespace(vocab_size=VOCAB)
        self.options = types.SimpleNamespace(token_buckets=(64,))

    def forward(self, batches, *, logits="all"):
        rows = [None if b is None else self._logits(b) for b in batches]
        if logits == "all":
            return rows
        picked = [None if b is None else last_rows.last_rows(b) for b in batches]
        return [None if r is None else r[p] for r, p in zip(rows, picked, strict=True)]

    @staticmethod
    def _logits(batch):
        ids, pos = np.asarray(batch.input_ids), np.asarray(batch.positions)
        phase = (ids[:, None] * 7 + pos[:, None] * 3 + np.arange(VOCAB)[None]) % VOCAB
        return np.sin(phase.astype(np.float64)) * 2

    def tbo_summary(self):
        return ""


def test_generate_samples_per_request_whatever_the_rank():
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    params = sampling.SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    streamed = []
    runs = [
        generate_lib.generate(
            _FakeRunner(dp), prompts, max_new_tokens=6, sampling_params=params, progress=False,
            on_token=(lambda i, t: streamed.append((i, t))) if dp == 1 else None,
        )
        for dp in (1, 3)
    ]  # fmt: skip
    tokens = [[r.token_ids for r in run] for run in runs]
    assert tokens[0] == tokens[1]
    for index, prompt in enumerate(prompts):  # the same draws, by hand
        generator, history = sampling.request_generator(params, index), list(prompt)
        for _ in range(6):
            row = _FakeRunner._logits(
                types.SimpleNamespace(input_ids=history[-1:], positions=[len(history) - 1])
            )[0]
            history.append(sampling.next_token(row, params, generator))
        assert tokens[0][index] == history[len(prompt) :]
        assert [t for i, t in streamed if i == index] == tokens[0][index]
    greedy = generate_lib.generate(_FakeRunner(2), prompts, max_new_tokens=6, progress=False)
    assert [r.token_ids for r in greedy] != tokens[0]
