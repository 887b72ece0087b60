"""Greedy generation: TBO and plain runners give identical tokens, equal to the reference's."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import model as model_lib
from jtbo.models import reference
from jtbo.runner import runner as runner_lib
from jtbo.runner import tbo_options
from tests.runner import helpers

NEW_TOKENS = 32
# One dense and one MoE layer: the serving loop is what is checked, and every program it
# compiles has fewer layers (tests/runner/test_runner.py covers the deeper TBO steps).
CONFIG = helpers.TWO_LAYER_TINY


def _reference_greedy(model, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(reference.reference_causal_logits(model, tokens)[-1])))
    return tokens[len(prompt) :]


def test_generate_tbo_matches_plain_and_reference_and_rejects_bad_requests():
    model = model_lib.MoEModel(CONFIG, rngs=nnx.Rngs(3))
    mesh = mesh_lib.make_mesh(4, 2)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 128, int(n)).tolist() for n in rng.integers(3, 12, 10)]
    bad = {3: [], 6: [1, 2, 128], 8: [1] * 140}  # empty, outside vocab, over the KV budget
    for index, prompt in bad.items():
        prompts.insert(index, prompt)
    outputs = []
    for tbo in (False, True):
        runner = runner_lib.ModelRunner(
            model, mesh, tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo),
            max_total_tokens=160,
            max_running_requests=4, token_buckets=(8, 16), dtype=jnp.float32,
        )  # fmt: skip
        outputs.append(runner.generate(prompts, max_new_tokens=NEW_TOKENS, chunk_size=8))
        # EXTEND/DECODE kinds x bucket 8/16 x (TBO child capacity or not): a handful, not per step.
        assert runner.num_steps > NEW_TOKENS
        assert runner.compile_count <= 6, runner.compile_count
        if tbo:
            assert 0 < runner.num_tbo_steps < runner.num_steps
    plain, overlapped = outputs
    for index, (a, b) in enumerate(zip(plain, overlapped, strict=True)):
        if index in bad:
            assert a.error and b.error and a.token_ids == [] == b.token_ids
            continue
        assert a.error is None and len(a.token_ids) == NEW_TOKENS
        assert a.token_ids == b.token_ids
    assert "empty" in plain[3].error and "vocabulary" in plain[6].error
    assert "KV budget" in plain[8].error
    for index in (0, 5):
        assert plain[index].token_ids == _reference_greedy(model, prompts[index], NEW_TOKENS)


def test_mixed_chunk_steps_give_the_tokens_of_separate_prefill_and_decode_steps():
    # Four rows for ten prompts: prompts are admitted while others decode, and with
    # mixed_chunk their chunks share MIXED steps with those decodes (one DP rank, so a
    # "mixed" step is a MIXED batch). Tokens equal the separate steps' and the reference's,
    # with 0, 1 or 2 (``True``) steps in flight.
    model = model_lib.MoEModel(CONFIG, rngs=nnx.Rngs(7))
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 128, int(n)).tolist() for n in rng.integers(3, 14, 10)]
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(1, 2), max_total_tokens=160, max_running_requests=4,
        token_buckets=(8, 16), dtype=jnp.float32,
    )  # fmt: skip
    outputs, kinds = {}, {}
    for mixed, pipeline in ((False, True), (True, True), (True, False), (True, 1), (False, 1)):
        log = []
        out = runner.generate(
            prompts, max_new_tokens=6, chunk_size=8, mixed_chunk=mixed, pipeline=pipeline,
            step_log=log,
        )  # fmt: skip
        outputs[mixed, pipeline] = [r.token_ids for r in out]
        kinds[mixed, pipeline] = [record.kind for record in log]
    assert "mixed" not in kinds[False, True]
    assert kinds[True, True].count("mixed") >= 3
    assert len(kinds[True, True]) < len(kinds[False, True])  # decodes no longer wait
    assert outputs[True, True] == outputs[True, False] == outputs[False, True]
    assert outputs[True, 1] == outputs[False, 1] == outputs[True, True]
    for index in (0, 9):
        assert outputs[True, True][index] == _reference_greedy(model, prompts[index], 6)
    with pytest.raises(ValueError, match=r"pipeline=-1: pass a bool or an int >= 0"):
        runner.generate(prompts, max_new_tokens=1, pipeline=-1)
