"""The unsharded reference: causal, padding-invariant, and its dense MoE equals the slot path."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo.models import config as config_lib
from jtbo.models import experts, reference, router
from jtbo.models import model as model_lib


def _model():
    return model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(1))


def test_reference_is_causal_and_padding_invariant():
    model = _model()
    tokens = np.random.default_rng(0).integers(0, 128, 12)
    full = reference.reference_causal_logits(model, tokens)
    prefix = reference.reference_causal_logits(model, tokens[:7])
    chex.assert_trees_all_close(full[:7], prefix, atol=1e-5, rtol=1e-5)
    eager = reference.reference_forward(model, tokens, np.arange(12), reference.causal_mask(12))
    chex.assert_trees_all_close(full, np.asarray(eager), atol=1e-5, rtol=1e-5)
    assert np.abs(full[-1] - full[-2]).max() > 1e-3  # rows differ: the data is not degenerate


def test_dense_moe_reference_equals_capacity_slots():
    model = _model()
    config = model.config
    block = model.layers[1].moe
    x = jnp.asarray(np.random.default_rng(2).normal(size=(9, config.hidden_size)), jnp.float32)
    want = reference.moe_dense_reference(block, x, config)
    weights, ids = router.select_experts(
        block.router.gate(x), block.router.correction_bias[...], config
    )
    got = experts.experts_capacity(x, ids, weights, block.experts.weights) + block.shared(x)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_cast_changes_dtype_and_keeps_values():
    model = _model()
    half = model_lib.cast(model, jnp.bfloat16)
    assert half.layers[1].moe.experts.w_gate_up[...].dtype == jnp.bfloat16
    assert model.layers[1].moe.experts.w_gate_up[...].dtype == jnp.float32
    chex.assert_trees_all_close(
        half.embed.table[...].astype(jnp.float32), model.embed.table[...], atol=1e-2, rtol=1e-2
    )


def test_cast_keeps_fp8_experts_and_their_scales():
    # Abstractly (no values): the dtypes are what cast decides.
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), expert_dtype="float8_e4m3fn")
    half = nnx.eval_shape(
        lambda: model_lib.cast(model_lib.MoEModel(config, rngs=nnx.Rngs(1)), jnp.bfloat16)
    )
    _, state = nnx.split(half)
    dtypes = {
        tuple(getattr(key, "key", None) for key in path)[:-1]: leaf.dtype
        for path, leaf in jax.tree_util.tree_leaves_with_path(state)
    }
    fp8, f32 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)
    kept = dict(w_gate_up=fp8, w_down=fp8, w_gate_up_scale=f32, w_down_scale=f32)
    experts = {path: dtype for path, dtype in dtypes.items() if "experts" in path}
    assert experts == {path: kept[path[-1]] for path in experts}
    assert len(experts) == 4 * sum(config.is_moe_layer)
    others = {dtype for path, dtype in dtypes.items() if path not in experts}
    assert others == {jnp.dtype(jnp.bfloat16)}  # everything else is cast
