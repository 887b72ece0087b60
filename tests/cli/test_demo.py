"""The demo's reference check: a runner step against the float64 reference forward."""

import argparse

import numpy as np
from flax import nnx

from jtbo.cli import demo
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import model as model_lib


def test_reference_error_is_small_for_the_runner_and_large_for_swapped_ranks():
    config = config_lib.MoEConfig.tiny()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, 6).tolist() for _ in range(2)]
    args = argparse.Namespace(moe_a2a_backend="ep", max_new_tokens=1)
    runner, _, _ = demo._serve(model, mesh_lib.make_mesh(4, 2), False, prompts, args)
    logits = demo._shared_step_logits(runner, prompts)
    assert demo._reference_error(model, prompts, logits) <= demo.REFERENCE_TOLERANCE
    # Rank 0 prefilled prompt 0 and rank 3 prompt 1: the check must see a rank mix-up.
    assert demo._reference_error(model, prompts, logits[::-1]) > 0.1
