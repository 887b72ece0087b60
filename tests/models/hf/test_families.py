"""config.json <-> MoEConfig: the mapping, and a ValueError naming every unsupported field."""

import json

import pytest

from jtbo.models.hf import families
from tests.models.hf import fixtures


def _raw(family: str) -> dict:
    return json.loads((fixtures.directory(family) / "config.json").read_text())


def test_fixture_configs_map_to_the_expected_moe_configs():
    qwen3 = families.FAMILIES["qwen3_moe"].to_moe_config(_raw("qwen3_moe"))
    assert qwen3.qk_norm and qwen3.tie_word_embeddings and qwen3.norm_topk_prob
    assert qwen3.head_dim == 8 and qwen3.hidden_size == 48 and qwen3.num_shared_experts == 0
    assert qwen3.is_moe_layer == (True, False, True)  # mlp_only_layers=[1]
    qwen2 = families.FAMILIES["qwen2_moe"].to_moe_config(_raw("qwen2_moe"))
    assert qwen2.shared_expert_gate and qwen2.qkv_bias and qwen2.shared_width == 40
    assert qwen2.is_moe_layer == (False, True, False)  # decoder_sparse_step=2
    assert qwen2.rope_scaling_factor == 2.0 and not qwen2.norm_topk_prob
    mixtral = families.FAMILIES["mixtral"].to_moe_config(_raw("mixtral"))
    assert mixtral.norm_topk_prob and mixtral.rope_theta == 1e6 and mixtral.head_dim == 8
    assert mixtral.moe_intermediate_size == 24 and all(mixtral.is_moe_layer)
    v2 = families.FAMILIES["deepseek_v2"].to_moe_config(_raw("deepseek_v2"))
    assert v2.attention_kind == "mla" and v2.q_lora_rank is None and v2.kv_lora_rank == 16
    assert (v2.qk_nope_head_dim, v2.qk_rope_head_dim, v2.v_head_dim) == (8, 4, 8)
    assert v2.router_topk_method == "group_limited_greedy" and v2.scoring_func == "softmax"
    assert v2.shared_width == 32 and v2.is_moe_layer == (False, True, True)
    assert v2.routed_scaling_factor == 1.5 and not v2.use_score_correction_bias
    v3 = families.FAMILIES["deepseek_v3"].to_moe_config(_raw("deepseek_v3"))
    assert v3.q_lora_rank == 16 and v3.router_topk_method == "noaux_tc"
    assert v3.use_score_correction_bias and v3.scoring_func == "sigmoid" and v3.norm_topk_prob
    assert (v3.n_group, v3.topk_group, v3.routed_scaling_factor) == (4, 2, 2.5)
    assert v3.rope_scaling_type == "yarn" and v3.rope_scaling_factor == 4.0
    assert (v3.rope_yarn_mscale, v3.rope_yarn_mscale_all_dim) == (1.0, 0.8)
    assert v3.rope_yarn_original_max_position == 16


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_to_hf_config_reads_back_the_same_config(family):
    spec = families.FAMILIES[family]
    config = spec.to_moe_config(_raw(family))
    assert spec.to_moe_config(spec.to_hf_config(config)) == config


def test_legacy_rope_fields_are_read():
    raw = _raw("qwen2_moe")
    del raw["rope_parameters"]
    raw.update(rope_theta=500.0, rope_scaling=dict(type="linear", factor=4.0))
    config = families.FAMILIES["qwen2_moe"].to_moe_config(raw)
    assert (config.rope_theta, config.rope_scaling_factor) == (500.0, 4.0)


@pytest.mark.parametrize(
    "family, edit, message",
    [
        ("qwen3_moe", dict(model_type="llama"),
         r"model_type 'llama' \(expected one of \['deepseek_v2', 'deepseek_v3', 'mixtral', "
         r"'qwen2_moe', 'qwen3_moe'\]"),
        ("qwen3_moe", dict(use_sliding_window=True),
         r"use_sliding_window=True \(expected one of \[False\]\): sliding-window"),
        ("mixtral", dict(sliding_window=4096),
         r"sliding_window=4096 \(expected one of \[None\]\)"),
        ("qwen2_moe", dict(layer_types=["sliding_attention", "full_attention", "full_attention"]),
         r"layer_types with \['sliding_attention'\]"),
        ("qwen3_moe", dict(hidden_act="gelu"), r"hidden_act='gelu' \(expected one of \['silu'\]"),
        ("qwen3_moe", dict(attention_bias=True), r"attention_bias=True"),
        ("qwen3_moe", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1.0, factor=4.0)),
         r"rope_parameters.rope_type='yarn' \(expected one of \['default', 'linear'\]\)"),
        ("qwen3_moe", dict(rope_parameters=dict(rope_type="linear", rope_theta=1.0, factor=2.0,
                                                original_max_position_embeddings=8)),
         r"rope_parameters.\['original_max_position_embeddings'\]"),
        ("mixtral", dict(quantization_config=dict(quant_method="fp8")),
         r"unsupported config field\(s\) \['quantization_config'\] for model_type 'mixtral'"),
        ("qwen2_moe", dict(shared_expert_intermediate_size=0),
         r"shared_expert_intermediate_size=0"),
        ("deepseek_v3", dict(quantization_config=dict(quant_method="fp8",
                                                      weight_block_size=[128])),
         r"quantization_config.weight_block_size=\[128\]"),
        ("deepseek_v3", dict(topk_method="greedy"), r"topk_method='greedy' \(expected one of "
         r"\['noaux_tc'\]\)"),
        ("deepseek_v2", dict(topk_method="noaux_tc"), r"topk_method='noaux_tc'"),
        ("deepseek_v3", dict(rope_interleave=False), r"rope_interleave=False"),
        ("deepseek_v2", dict(num_key_value_heads=2), r"num_key_value_heads=2 \(expected "
         r"num_attention_heads=4"),
        ("deepseek_v2", dict(moe_layer_freq=2), r"moe_layer_freq=2"),
        ("deepseek_v3", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1.0, factor=4.0,
                                                  attention_factor=2.0)),
         r"rope_parameters.\['attention_factor'\] for rope_type 'yarn'"),
    ],
)  # fmt: skip
def test_unsupported_config_fields_raise(family, edit, message):
    raw = dict(_raw(family), **edit)
    with pytest.raises(ValueError, match=message):
        families.family_of(raw).to_moe_config(raw)


def test_missing_required_field_is_named():
    raw = _raw("mixtral")
    del raw["num_local_experts"]
    with pytest.raises(ValueError, match="mixtral config.json lacks the field num_local_experts"):
        families.FAMILIES["mixtral"].to_moe_config(raw)
