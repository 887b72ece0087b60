"""Device sampler: against its float64 numpy reference, plus greedy, ties, keys and statistics."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jtbo import aot
from jtbo.models import sampler
from tests.kernels import helpers

# How far (in probability mass, or relative to a probability) a float64 decision must be from
# its boundary for the float32 sampler to be required to agree. float32 rounds the scaled
# logits (|logits / temperature| <= ~160 here, one ulp ~1.5e-5) and sums up to 300
# probabilities, so its probabilities and cumulative sums can be off by a few 1e-5.
_MARGIN = 1e-4

_jit_sample = jax.jit(sampler.sample_rows, static_argnames="greedy_only")


def _ranked_probs(row: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(probabilities in descending order, their vocabulary ids)`` of one row."""
    scaled = row.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    return probs[order], order


def _well_conditioned(row, temperature, top_p, uniform) -> bool:
    """Whether float32 rounding cannot change this row's token (see ``_MARGIN``).

    The sorted position drawn only grows with ``top_p`` and with the uniform (a larger nucleus
    or a larger target moves the first cumulative sum above the target later), so if both
    corners of the box ``(top_p, uniform) +- margin`` draw the same token, every point in it
    does: the nucleus cut and the target are safely inside their intervals. The token must
    also not be nearly tied with its sorted neighbours, or float32 could order them the other
    way round.
    """
    if temperature == 0:
        return True  # argmax of the very same float32 values on both sides
    one = row[None, :]
    low, high = (
        sampler.sample_rows_reference(
            one, [temperature], [top_p + sign * _MARGIN], [uniform + sign * _MARGIN]
        )[0]
        for sign in (-1, 1)
    )
    if low != high:
        return False
    ranked, order = _ranked_probs(row, temperature)
    position = int(np.flatnonzero(order == low)[0])
    neighbours = [ranked[k] for k in (position - 1, position + 1) if 0 <= k < len(ranked)]
    return all(abs(p - ranked[position]) > _MARGIN * ranked[position] for p in neighbours)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 8),
    vocab=st.sampled_from([5, 17, 64, 151, 300]),
    scale=st.sampled_from([0.5, 2.0, 4.0]),
)
def test_sample_rows_matches_reference(seed, rows, vocab, scale):
    rng = np.random.default_rng(seed)
    logits = (scale * rng.normal(size=(rows, vocab))).astype(np.float32)
    temperature = np.where(rng.random(rows) < 0.3, 0.0, rng.uniform(0.1, 2.0, rows))
    temperature = temperature.astype(np.float32)
    top_p = np.where(rng.random(rows) < 0.3, 1.0, rng.uniform(1e-3, 1.0, rows)).astype(np.float32)
    uniforms = sampler.sampling_uniforms(
        rng.integers(0, 2**31 - 1, rows), np.arange(rows), rng.integers(0, 1000, rows)
    )
    got = np.asarray(_jit_sample(logits, temperature, top_p, uniforms))
    assert got.dtype == np.int32 and got.shape == (rows,)
    want = sampler.sample_rows_reference(logits, temperature, top_p, np.asarray(uniforms))
    # float32 and float64 may legitimately disagree on a row whose nucleus cut or target sits
    # within rounding distance of a boundary; compare only the rows that are safely inside.
    checked = np.array(
        [
            _well_conditioned(logits[i], temperature[i], top_p[i], float(uniforms[i]))
            for i in range(rows)
        ]
    )
    assume(checked.any())
    np.testing.assert_array_equal(got[checked], want[checked])


def test_greedy_rows_take_the_first_maximum():
    logits = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [0.0, -1.0, 4.0, 4.0]])
    logits = logits.astype(np.float32)
    zeros = np.zeros(3, np.float32)
    uniforms = np.array([0.9, 0.5, 0.99], np.float32)
    want = np.array([1, 0, 2], np.int32)
    np.testing.assert_array_equal(sampler.sample_rows(logits, zeros, zeros + 1, uniforms), want)
    np.testing.assert_array_equal(sampler.sample_rows_reference(logits, zeros, 1, uniforms), want)
    # greedy_only ignores the temperatures: every row is the argmax.
    hot = np.full(3, 2.0, np.float32)
    got = _jit_sample(logits, hot, zeros + 1, uniforms, greedy_only=True)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.int32


def test_greedy_only_skips_the_sort():
    args = (jnp.zeros((2, 16)), jnp.ones(2), jnp.ones(2), jnp.zeros(2))
    sampled = str(jax.make_jaxpr(sampler.sample_rows)(*args))
    greedy = str(jax.make_jaxpr(lambda *a: sampler.sample_rows(*a, greedy_only=True))(*args))
    assert "sort" in sampled
    assert "sort" not in greedy and "cumsum" not in greedy


def _tied_logits(seed: int, scale: float, shape) -> np.ndarray:
    """Random logits rounded to bf16, which takes few distinct values, so many probabilities
    tie; a scale of 200 makes most of them underflow to exactly 0."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=shape) * scale, jnp.bfloat16)
    return np.asarray(logits.astype(jnp.float32))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([0.5, 8.0, 200.0]))
def test_sort_descending_is_numpys_sort_of_the_probabilities(seed, scale):
    probs = jax.nn.softmax(jnp.asarray(_tied_logits(seed, scale, (3, 257))), axis=-1)
    sorted_probs = jax.jit(sampler.sort_descending)(probs)
    want = -np.sort(-np.asarray(probs), axis=-1)
    np.testing.assert_array_equal(np.asarray(sorted_probs).view(np.uint32), want.view(np.uint32))


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.5, 4.0]),
    top_p=st.sampled_from([0.3, 0.9, 1.0]),
)
def test_tied_probabilities_draw_the_stable_orders_token(seed, scale, top_p):
    # Many exact ties (bf16 logits) under an unstable sort: each row's token must be the one
    # the stable order puts at the drawn position, as in the float64 reference. Exact ties
    # are ties in float64 too, so only the nucleus cut and the target need a margin.
    rows, vocab = 16, 301
    logits = _tied_logits(seed, scale, (rows, vocab))
    temperature = np.ones(rows, np.float32)
    top_p = np.full(rows, top_p, np.float32)
    uniforms = np.random.default_rng(seed + 1).uniform(0, 1, rows).astype(np.float32)
    got = np.asarray(_jit_sample(logits, temperature, top_p, uniforms))
    want = sampler.sample_rows_reference(logits, temperature, top_p, uniforms)
    margin_corners = [
        sampler.sample_rows_reference(
            logits, temperature, top_p + sign * _MARGIN, uniforms + sign * _MARGIN
        )
        for sign in (-1, 1)
    ]
    checked = margin_corners[0] == margin_corners[1]
    assume(checked.sum() >= rows // 2)
    np.testing.assert_array_equal(got[checked], want[checked])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_sort_descending_refuses_other_dtypes(dtype):
    with pytest.raises(ValueError, match=f"float32 probabilities, got {jnp.dtype(dtype).name}"):
        sampler.sort_descending(jnp.ones((2, 8), dtype))


def test_the_sort_compares_unsigned_keys_with_one_less_than():
    # The form that XLA's GPU compiler can run as CUB's radix sort: unsigned keys alone,
    # compared with one `<`, unstable (its StableSortExpander would add a tie-break operand
    # to a stable sort's comparator). Read from the H200 compile's optimized module.
    if not aot.aot_available():
        pytest.skip("the aot extra (jax-cuda12-plugin) is not installed")
    text = helpers.compiled_for_h200(sampler.sort_descending, [((4, 4096), jnp.float32)])
    [sort_line] = [line for line in text.splitlines() if " sort(" in line]
    assert "u32[4,4096]" in sort_line and "is_stable=true" not in sort_line
    comparator = sort_line.split("to_apply=")[1].split(",")[0].split()[0]
    body = text.split(f"{comparator} (")[1].split("\n}")[0]
    assert body.count("compare(") == 1 and "direction=LT" in body
    assert "select(" not in body and "parameter(2)" not in body


def _h200_divides(rows: int, vocab: int) -> int:
    """``[rows, vocab]`` float32 divisions in ``sample_rows``' optimized H200 module."""
    text = helpers.compiled_for_h200(  # a new function: traced again
        lambda *args: sampler.sample_rows(*args),
        [((rows, vocab), jnp.float32)] + [((rows,), jnp.float32)] * 3,
    )
    return sum(f"f32[{rows},{vocab}]" in line and " divide(" in line for line in text.splitlines())


def test_the_probabilities_are_computed_once_in_the_h200_compile(monkeypatch):
    # The drawn token is found by comparing the sorted probabilities' bits with the
    # probabilities in vocabulary order: both must be the same computed values. Without the
    # optimization barrier, XLA divides the exponentials by their sum again in fusions that
    # read the probabilities, where the lowering may differ.
    if not aot.aot_available():
        pytest.skip("the aot extra (jax-cuda12-plugin) is not installed")
    barriered = _h200_divides(8, 151936)  # Qwen3's vocabulary
    monkeypatch.setattr(jax.lax, "optimization_barrier", lambda x: x)
    assert _h200_divides(8, 151936) >= barriered + 1


def _assert_both_sample(logits, temperature, top_p, uniforms, want) -> None:
    """The device sampler and the numpy reference both draw ``want``."""
    got = sampler.sample_rows(logits, temperature, top_p, uniforms)
    np.testing.assert_array_equal(got, np.asarray(want, np.int32))
    reference = sampler.sample_rows_reference(logits, temperature, top_p, uniforms)
    np.testing.assert_array_equal(reference, np.asarray(want, np.int32))


def test_inverse_cdf_runs_in_sorted_order():
    # probabilities [0.2, 0.5, 0.3]: sorted order is token 1, 2, 0 with cumulative 0.5, 0.8, 1.
    logits = np.log(np.array([0.2, 0.5, 0.3], np.float32))[None, :].repeat(4, 0)
    temperature = np.ones(4, np.float32)
    uniforms = np.array([0.1, 0.6, 0.9, 0.9], np.float32)
    # the last row keeps the nucleus {1, 2} (0.5 of more likely mass < 0.6, 0.8 is not):
    # target 0.9 * 0.8 = 0.72 falls in token 2's interval (0.5, 0.8].
    top_p = np.array([1.0, 1.0, 1.0, 0.6], np.float32)
    _assert_both_sample(logits, temperature, top_p, uniforms, [1, 2, 0, 2])


def test_equal_probabilities_keep_vocabulary_order():
    logits = np.zeros((4, 4), np.float32)  # four tokens of exactly 0.25 each
    temperature = np.ones(4, np.float32)
    # top_p 0.5 keeps tokens 0 and 1 (0.5 of more likely mass is not < 0.5), mass 0.5.
    top_p = np.array([1.0, 1.0, 0.5, 0.5], np.float32)
    uniforms = np.array([0.3, 0.8, 0.3, 0.7], np.float32)
    _assert_both_sample(logits, temperature, top_p, uniforms, [1, 3, 0, 1])


def test_uniforms_do_not_depend_on_batching():
    rng = np.random.default_rng(0)
    seed = rng.integers(0, 2**31 - 1, (2, 5)).astype(np.int32)
    request = rng.integers(0, 100, (2, 5)).astype(np.int32)
    token = rng.integers(0, 4000, (2, 5)).astype(np.int32)
    batched = np.asarray(jax.jit(sampler.sampling_uniforms)(seed, request, token))
    assert batched.shape == (2, 5) and batched.dtype == np.float32
    single = [
        float(sampler.sampling_uniforms(s, r, t))
        for s, r, t in zip(seed.ravel(), request.ravel(), token.ravel(), strict=True)
    ]
    np.testing.assert_array_equal(batched.ravel(), np.array(single, np.float32))
    permutation = rng.permutation(10)
    shuffled = sampler.sampling_uniforms(
        seed.ravel()[permutation], request.ravel()[permutation], token.ravel()[permutation]
    )
    np.testing.assert_array_equal(np.asarray(shuffled), batched.ravel()[permutation])


def test_uniforms_differ_across_tokens_and_lie_in_unit_interval():
    tokens = np.arange(4096, dtype=np.int32)
    values = np.asarray(sampler.sampling_uniforms(11, 3, tokens))
    assert values.dtype == np.float32
    assert np.all(values >= 0) and np.all(values < 1)
    # 23 random bits a value: 4096 of them collide about once (birthday), neighbours never.
    assert np.all(values[1:] != values[:-1]) and len(np.unique(values)) > len(values) - 8
    assert abs(values.mean() - 0.5) < 0.03
    other_request = np.asarray(sampler.sampling_uniforms(11, 4, tokens))
    other_seed = np.asarray(sampler.sampling_uniforms(12, 3, tokens))
    assert np.mean(values == other_request) < 0.01 and np.mean(values == other_seed) < 0.01


def test_tiny_top_p_keeps_only_the_most_likely_token():
    rng = np.random.default_rng(1)
    rows, vocab = 64, 151
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    uniforms = np.linspace(0.0, 1.0, rows, endpoint=False, dtype=np.float32)
    uniforms[-1] = np.nextafter(np.float32(1), np.float32(0))  # the largest float32 below 1
    temperature = np.full(rows, 1.5, np.float32)
    top_p = np.full(rows, 1e-6, np.float32)
    got = _jit_sample(logits, temperature, top_p, uniforms)
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))


def test_huge_temperature_is_roughly_uniform():
    draws, vocab = 2000, 8
    logits = 3.0 * np.random.default_rng(2).normal(size=(vocab,)).astype(np.float32)
    logits = np.broadcast_to(logits, (draws, vocab))
    uniforms = sampler.sampling_uniforms(7, np.arange(draws), 0)
    tokens = _jit_sample(logits, np.full(draws, 1e4, np.float32), np.ones(draws), uniforms)
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    # 250 expected per token, standard deviation ~14.8: +-75 is five of them (and the draws
    # are deterministic, so this cannot flake).
    assert counts.sum() == draws and np.all(np.abs(counts - draws / vocab) < 75), counts
    # at temperature 1 the same logits are far from uniform
    cold = _jit_sample(logits, np.ones(draws, np.float32), np.ones(draws), uniforms)
    assert np.bincount(np.asarray(cold), minlength=vocab).max() > 500


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_logprobs_match_numpy(dtype):
    rng = np.random.default_rng(3)
    logits = jnp.asarray(3.0 * rng.normal(size=(2, 3, 151)), dtype)
    tokens = rng.integers(0, 151, (2, 3)).astype(np.int32)
    got = sampler.token_logprobs(logits, tokens)
    exact = np.asarray(logits.astype(jnp.float32), np.float64)
    shifted = exact - exact.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = np.take_along_axis(log_softmax, tokens[..., None], -1)[..., 0]
    assert got.dtype == jnp.float32 and got.shape == (2, 3)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_sample_rows_compiles_once_for_any_settings():
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(logits, temperature, top_p, seed, token_index):
        uniforms = sampler.sampling_uniforms(seed, jnp.arange(4), token_index)
        return sampler.sample_rows(logits, temperature, top_p, uniforms)

    rng = np.random.default_rng(4)
    settings_per_step = [
        (np.zeros(4), np.ones(4)),  # all greedy
        (np.full(4, 0.7), np.full(4, 0.9)),
        (np.array([0.0, 1.0, 2.0, 0.5]), np.array([1.0, 0.1, 0.5, 1.0])),
    ]
    for step_index, (temperature, top_p) in enumerate(settings_per_step):
        logits = rng.normal(size=(4, 33)).astype(np.float32)
        step(
            logits,
            temperature.astype(np.float32),
            top_p.astype(np.float32),
            np.int32(step_index),
            np.full(4, step_index, np.int32),
        ).block_until_ready()


def test_two_dim_batch_matches_the_flat_batch():
    rng = np.random.default_rng(5)
    dp, rows, vocab = 2, 3, 151
    logits = rng.normal(size=(dp, rows, vocab)).astype(np.float32)
    temperature = np.array([[0.0, 1.0, 0.6], [1.3, 0.0, 0.9]], np.float32)
    top_p = np.array([[1.0, 0.8, 1.0], [0.5, 1.0, 0.95]], np.float32)
    seed = np.full((dp, rows), 9, np.int32)
    request = np.arange(dp * rows, dtype=np.int32).reshape(dp, rows)
    token = np.full((dp, rows), 17, np.int32)
    uniforms = jax.jit(sampler.sampling_uniforms)(seed, request, token)
    flat_uniforms = sampler.sampling_uniforms(seed.ravel(), request.ravel(), token.ravel())
    np.testing.assert_array_equal(np.asarray(uniforms).ravel(), np.asarray(flat_uniforms))
    got = _jit_sample(logits, temperature, top_p, uniforms)
    assert got.shape == (dp, rows)
    flat = _jit_sample(logits.reshape(-1, vocab), temperature.ravel(), top_p.ravel(), flat_uniforms)
    np.testing.assert_array_equal(np.asarray(got).ravel(), np.asarray(flat))
    want = sampler.sample_rows_reference(logits, temperature, top_p, np.asarray(uniforms))
    np.testing.assert_array_equal(got, want)
    logprobs = jax.jit(sampler.token_logprobs)(logits, got)
    flat_logprobs = sampler.token_logprobs(logits.reshape(-1, vocab), flat)
    np.testing.assert_array_equal(np.asarray(logprobs).ravel(), np.asarray(flat_logprobs))


def test_bfloat16_logits_sample_like_their_float32_values():
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(6, 64)), jnp.bfloat16)
    temperature = np.array([0.0, 1.0, 0.5, 2.0, 1.0, 0.0], np.float32)
    top_p = np.array([1.0, 1.0, 0.7, 0.9, 0.3, 1.0], np.float32)
    uniforms = sampler.sampling_uniforms(5, np.arange(6), 0)
    got = _jit_sample(logits, temperature, top_p, uniforms)
    want = _jit_sample(logits.astype(jnp.float32), temperature, top_p, uniforms)
    np.testing.assert_array_equal(got, want)
