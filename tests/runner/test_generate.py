"""Greedy generation: TBO and plain runners give identical tokens, equal to the reference's."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import model as model_lib
from jtbo.models import reference
from jtbo.runner import runner as runner_lib
from jtbo.runner import tbo_options

NEW_TOKENS = 32


def _reference_greedy(model, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(reference.reference_causal_logits(model, tokens)[-1])))
    return tokens[len(prompt) :]


def test_generate_tbo_matches_plain_and_reference_and_rejects_bad_requests():
    config = config_lib.MoEConfig.tiny()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(3))
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
