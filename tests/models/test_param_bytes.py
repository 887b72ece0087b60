"""Parameter bytes from MoEConfig arithmetic against the model's own parameters.

The model is built abstractly (``nnx.eval_shape``, no values), cast to the serving dtype as
the runner casts it, and its parameters grouped by the step's partition specs: the routed
experts, those split over ``attn_tp``, and the replicated rest. The arithmetic must give
exactly those bytes for every layout (GQA and MLA, with and without the optional parameters,
float and FP8 experts with ragged blocks).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import model as model_lib
from jtbo.models import param_bytes, step

FP8 = dict(expert_dtype="float8_e4m3fn")
CONFIGS = {
    "tiny": config_lib.MoEConfig.tiny(),
    "tiny_softmax": config_lib.MoEConfig.tiny_softmax(),
    "tiny_mla": config_lib.MoEConfig.tiny_mla(),
    "mla_full_q": dataclasses.replace(config_lib.MoEConfig.tiny_mla(), q_lora_rank=None),
    "every_option": dataclasses.replace(
        config_lib.MoEConfig.tiny_softmax(),
        qkv_bias=True,
        qk_norm=True,
        tie_word_embeddings=True,
        num_shared_experts=1,
        shared_expert_gate=True,
        mlp_only_layers=(2,),
    ),  # fmt: skip
    "tiny_fp8_ragged": dataclasses.replace(
        config_lib.MoEConfig.tiny(), expert_block_size=(24, 20), **FP8
    ),
    "mla_fp8": dataclasses.replace(config_lib.MoEConfig.tiny_mla(), **FP8),
    "deepseek_v3_reduced_fp8": dataclasses.replace(
        config_lib.MoEConfig.deepseek_v3_reduced(), **FP8
    ),
}


def _model_bytes(config, dtype) -> param_bytes.ParameterBytes:
    abstract = nnx.eval_shape(
        lambda: model_lib.cast(model_lib.MoEModel(config, rngs=nnx.Rngs(0)), dtype)
    )
    _, state = nnx.split(abstract)
    specs = jax.tree.leaves(step.param_specs(state, "ep"))
    groups = dict(routed=0, heads=0, replicated=0)
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(state), specs, strict=True):
        nbytes = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        if "experts" in jax.tree_util.keystr(path):
            groups["routed"] += nbytes
        elif mesh_lib.ATTN_TP_AXIS in spec:
            groups["heads"] += nbytes
        else:
            groups["replicated"] += nbytes
    return param_bytes.ParameterBytes(groups["routed"], groups["heads"], groups["replicated"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_arithmetic_counts_the_models_own_parameters(name):
    config = CONFIGS[name]
    assert param_bytes.parameter_bytes(config, 2) == _model_bytes(config, jnp.bfloat16)


def test_float32_and_the_per_device_share():
    config = CONFIGS["tiny_mla"]
    counted = param_bytes.parameter_bytes(config, 4)
    assert counted == _model_bytes(config, jnp.float32)
    share = counted.per_device(8, attn_tp_size=2)
    assert share == counted.replicated + counted.attention_heads / 2 + counted.routed_experts / 8
    assert counted.per_device(1) == counted.total
    with pytest.raises(ValueError, match="multiple of attn_tp_size=3"):
        counted.per_device(8, attn_tp_size=3)


def test_deepseek_v3_fp8_experts_halve_the_expert_bytes():
    bf16 = param_bytes.parameter_bytes(config_lib.MoEConfig.deepseek_v3())
    fp8 = param_bytes.parameter_bytes(
        dataclasses.replace(config_lib.MoEConfig.deepseek_v3(), **FP8)
    )
    # 58 MoE layers x 256 experts x 3 matrices of 7168 x 2048, plus a float32 scale per
    # 128 x 128 block (2 bytes per 16384 values).
    values = 58 * 256 * 3 * 7168 * 2048
    assert bf16.routed_experts == 2 * values
    assert fp8.routed_experts == values + values * 4 // (128 * 128)
    assert (fp8.attention_heads, fp8.replicated) == (bf16.attention_heads, bf16.replicated)
    assert fp8.per_device(8) < 141e9 < bf16.per_device(8)  # an H200's memory
