"""End-to-end MLA: ModelRunner with TBO on and off vs an unsharded float64 reference forward.

The MLA model (``MoEConfig.tiny_mla``: low-rank queries, YaRN RoPE) runs on 4 x 2 CPU devices
(attention heads split over ``attn_tp``, the latent replicated) an extend step (decompressed
attention), then decode and target-verify (absorbed attention) over the cached latent. The
reference runs the same parameters in float64 (``_float64`` says which pieces stay float32)
through dense attention with up-projected keys and values. Tolerance as ``test_runner``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import layer_ops, reference
from jtbo.models import model as model_lib
from jtbo.runner import runner as runner_lib
from jtbo.runner import tbo_options
from tests.runner import helpers

TOL = dict(atol=2e-4, rtol=2e-4)
DP, TP = 4, 2
TREE = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # root with two children
# Per rank: the new-token lengths of its requests. Rank 0: a balanced split; rank 1: one long
# prompt (two-chunk split); rank 3 idle. Both tests serve these shapes, so the native runner
# of the second test runs the first test's plain programs (one worker runs the module's tests:
# the shared model fixture), loaded from the run's compilation cache.
LENS = ([5, 3, 4], [14], [2, 6], None)


@pytest.fixture(scope="module")
def model():
    return model_lib.MoEModel(config_lib.MoEConfig.tiny_mla(), rngs=nnx.Rngs(0))


def _prompts(seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [
        None if lens is None else {r: rng.integers(0, 128, n).tolist() for r, n in enumerate(lens)}
        for lens in LENS
    ]


def _runner(model, tbo, **kwargs):
    return runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(DP, TP), moe=layer_ops.MoEOptions(moe_a2a_backend="ep"),
        tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo), max_total_tokens=64,
        max_running_requests=4, token_buckets=(8, 16, 32), dtype=jnp.float32, **kwargs,
    )  # fmt: skip


def _float64(fn, model, *args) -> np.ndarray:
    """``fn(model, *args)`` with the model's parameters in float64 (x64 on for the call).

    The attention, norms and MLPs then compute in float64; RoPE angles, the router and the LM
    head keep their float32 accumulation (the model's own pieces pin it).
    """
    with jax.enable_x64(True):
        return np.asarray(fn(model_lib.cast(model, jnp.float64), *args), np.float64)


def _steps(runner, prompts):
    """Extend, decode, verify; returns the three outputs and the per-rank bookkeeping."""
    rng = np.random.default_rng(5)
    ranks = [helpers.Rank() for _ in prompts]
    pairs = lambda xs: zip(ranks, xs, strict=True)  # noqa: E731
    outs = [runner.forward([None if p is None else r.extend(p) for r, p in pairs(prompts)])]
    history = [None if p is None else {k: list(ranks[i].tokens[k]) for k in p}
               for i, p in enumerate(prompts)]  # fmt: skip
    tokens = [None if p is None else {k: int(rng.integers(128)) for k in p} for p in prompts]
    outs.append(runner.forward([None if t is None else r.decode(t) for r, t in pairs(tokens)]))
    drafts = [None if p is None else {k: rng.integers(0, 128, 3).tolist() for k in p}
              for p in prompts]  # fmt: skip
    planned = [None if d is None else r.verify(d, TREE) for r, d in pairs(drafts)]
    outs.append(runner.forward([None if p is None else p[0] for p in planned]))
    return outs, ranks, history, drafts, planned


def _expected(model, prompt, history, ranks_tokens, drafts, positions):
    """Float64 logits of one rank's extend, decode and verify rows."""
    rows = sorted(prompt)
    extend = [_float64(reference.reference_causal_logits, model, history[k]) for k in rows]
    decode = [_float64(reference.reference_causal_logits, model, ranks_tokens[k])[-1:]
              for k in rows]  # fmt: skip
    verify = [_float64(helpers.reference_verify, model, ranks_tokens[k], drafts[k],
                       positions[k], TREE) for k in rows]  # fmt: skip
    return [np.concatenate(x) for x in (extend, decode, verify)]


def test_mla_extend_decode_verify_with_tbo_on_and_off_match_float64(model):
    prompts = _prompts(2)
    plain, tbo = _runner(model, False), _runner(model, True)
    got = {name: _steps(runner, prompts) for name, runner in (("plain", plain), ("tbo", tbo))}
    _, ranks, history, drafts, planned = got["plain"]
    for r, prompt in enumerate(prompts):
        if prompt is None:
            assert all(out[r] is None for out in got["tbo"][0])
            continue
        want = _expected(model, prompt, history[r], ranks[r].tokens, drafts[r], planned[r][1])
        for name in ("plain", "tbo"):
            for out, expected in zip(got[name][0], want, strict=True):
                chex.assert_trees_all_close(out[r], expected, **TOL)
    assert tbo.num_tbo_steps == 3 and plain.num_tbo_steps == 0


def test_mla_with_the_pallas_backend_matches_the_native_one(model):
    # attention_backend="pallas": decode and verify through the paged kernel over the latent
    # pool (the Pallas interpreter here), extend natively; same logits as the native backend.
    prompts = _prompts(6)
    outs = {}
    for backend in ("native", "pallas"):
        runner = _runner(model, False, attention_backend=backend)
        assert runner.parallel.attention_backend == backend
        outs[backend] = _steps(runner, prompts)[0]
    for step_native, step_pallas in zip(outs["native"], outs["pallas"], strict=True):
        for got, want in zip(step_pallas, step_native, strict=True):
            if want is not None:
                chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
