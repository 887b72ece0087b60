"""The MoE exchange operations' joint experts: one-device TBO steps against the unsharded
model (float32), with the joint grouped GEMM seen to run."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import experts as experts_lib
from jtbo.models import layer_ops, moe_exchange
from jtbo.models import model as model_lib
from jtbo.overlap import operations, row_joint
from jtbo.runner import runner as runner_lib
from jtbo.runner import tbo_options
from tests.runner import helpers

TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    "moe",
    [
        layer_ops.MoEOptions(moe_a2a_backend="ep", ep_capacity_factor=2.0),
        layer_ops.MoEOptions(moe_a2a_backend="ep", ep_dedup=True),
        layer_ops.MoEOptions(moe_a2a_backend="none"),
    ],
    ids=["ep", "ep-dedup", "none"],
)
def test_one_device_tbo_runs_both_micro_batches_experts_as_one_call(moe, monkeypatch):
    config = config_lib.MoEConfig.tiny()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(5))
    calls = []
    ffn = experts_lib.experts_ffn_slots
    monkeypatch.setattr(
        experts_lib,
        "experts_ffn_slots",
        lambda x, *a, **k: calls.append(x.shape) or ffn(x, *a, **k),
    )
    joint_ops = []  # row-wise operations run once for both micro-batches (small ones)
    run_joint = row_joint.run_joint
    monkeypatch.setattr(
        row_joint, "run_joint", lambda fn, *a: joint_ops.append(fn.__name__) or run_joint(fn, *a)
    )
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(1, 1), moe=moe, max_total_tokens=64, max_running_requests=4,
        token_buckets=(16, 32), dtype=jnp.float32,
        tbo=tbo_options.TboOptions(enable_two_batch_overlap=True),
    )  # fmt: skip
    rng = np.random.default_rng(3)
    rank = helpers.Rank()
    prompts = {row: rng.integers(0, 128, n).tolist() for row, n in enumerate([9, 3, 6])}
    (got,) = runner.forward([rank.extend(prompts)])
    want = helpers.reference_new_rows(model, rank, {k: len(v) for k, v in prompts.items()})
    chex.assert_trees_all_close(got, want, **TOL)
    for _ in range(2):
        tokens = {k: int(rng.integers(128)) for k in prompts}
        (got,) = runner.forward([rank.decode(tokens)])
        chex.assert_trees_all_close(
            got, helpers.reference_new_rows(model, rank, {k: 1 for k in tokens}), **TOL
        )
    # One long prompt: a two-chunk split, where B's queries read A's K/V from the pool.
    long_prompt = {3: rng.integers(0, 128, 14).tolist()}
    (got,) = runner.forward([rank.extend(long_prompt)])
    chex.assert_trees_all_close(got, helpers.reference_new_rows(model, rank, {3: 14}), **TOL)
    assert runner.num_tbo_steps == 4
    # One call per MoE layer and traced step (two extend buckets and a decode program), not
    # one per micro-batch.
    assert len(calls) == 3 * sum(config.is_moe_layer), calls
    row_wise = {"embed", "comm_prepare_attn", "attn_prepare", "comm_prepare_mlp", "gate", "output"}
    assert row_wise | {"final_norm"} <= set(joint_ops), sorted(set(joint_ops))


@pytest.mark.parametrize("backend", ["ep", "none"])
def test_experts_have_a_joint_form(backend):
    model = model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(0))
    moe = model.layers[config_lib.MoEConfig.tiny().is_moe_layer.index(True)].moe
    ops = (
        moe_exchange.ep_operations(moe, 1)
        if backend == "ep"
        else moe_exchange.gather_operations(moe)
    )
    assert isinstance(ops["experts"], operations.JointOperation)
    assert not any(
        isinstance(ops[name], operations.JointOperation) for name in ops if name != "experts"
    )
