import dataclasses

import pytest

from jtbo.models import config as config_lib


def test_every_field_has_a_description():
    described = config_lib.MoEConfig.describe()
    assert set(described) == {f.name for f in dataclasses.fields(config_lib.MoEConfig)}
    assert all(len(text) > 5 for text in described.values())


def test_presets_are_valid_and_frozen():
    tiny = config_lib.MoEConfig.tiny()
    deepseek = config_lib.MoEConfig.deepseek_v3_reduced()
    assert deepseek.hidden_size == 7168 and deepseek.num_experts == 64
    assert deepseek.num_experts_per_tok == 8 and deepseek.num_shared_experts == 1
    assert deepseek.num_layers == 4
    assert tiny.is_moe_layer == (False, True, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny.hidden_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(num_experts=6, n_group=4), "n_group"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(topk_group=5), "topk_group"),
        (dict(first_k_dense=4), "first_k_dense"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(scoring_func="relu"), "scoring_func"),
        (dict(head_dim=7), "head_dim"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step"),
        (dict(mlp_only_layers=(3,)), "mlp_only_layers"),
        (dict(mlp_only_layers=[1]), "mlp_only_layers"),
        (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
        (dict(num_shared_experts=0, shared_expert_gate=True), "shared_expert_gate"),
        (dict(rope_scaling_factor=0.0), "rope_scaling_factor"),
        (dict(expert_dtype="float16"), "expert_dtype"),
        (dict(expert_block_size=(128,)), "expert_block_size"),
        (dict(expert_block_size=(128, 0)), "expert_block_size"),
    ],
)
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        config_lib.MoEConfig(**changes)


def test_layer_kinds_follow_the_qwen_moe_rule():
    # Layer i is MoE iff i >= first_k_dense, i not in mlp_only_layers, (i + 1) % step == 0.
    config = config_lib.MoEConfig(
        num_layers=6, first_k_dense=0, decoder_sparse_step=2, mlp_only_layers=(3,)
    )
    assert config.is_moe_layer == (False, True, False, False, False, True)
    assert config_lib.MoEConfig(first_k_dense=2).is_moe_layer == (False, False, True)


def test_shared_width_defaults_to_the_shared_experts_times_the_expert_width():
    assert config_lib.MoEConfig(num_shared_experts=2).shared_width == 64
    assert config_lib.MoEConfig(shared_expert_intermediate_size=40).shared_width == 40
    assert config_lib.MoEConfig(num_shared_experts=0).shared_width == 0


def test_mla_presets_and_kv_pool_layout():
    gqa = config_lib.MoEConfig.deepseek_v3_gqa_reduced()
    assert gqa.attention_kind == "gqa" and gqa.kv_pool_heads(2) == (8, 128, 128)
    mla = config_lib.MoEConfig.deepseek_v3_reduced()
    assert (mla.hidden_size, mla.num_experts, mla.num_layers) == (7168, 64, 4)
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim) == (
        1536, 512, 192, 128,
    )  # fmt: skip
    assert mla.kv_pool_heads(2) == (2, 576, 0)  # one latent copy per attn_tp rank
    assert config_lib.MoEConfig.tiny_mla().rope_scaling_type == "yarn"


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(attention_kind="mha"), "attention_kind='mha'"),
        (dict(attention_kind="mla", qk_norm=True), "no qk_norm"),
        (dict(qk_rope_head_dim=3), "qk_rope_head_dim=3 must be even"),
        (dict(q_lora_rank=0), "q_lora_rank=0"),
        (dict(kv_lora_rank=0), "kv_lora_rank=0"),
        (dict(rope_scaling_type="ntk"), "rope_scaling_type='ntk'"),
    ],
)
def test_bad_mla_fields_are_named(edit, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(config_lib.MoEConfig.tiny(), **edit)
