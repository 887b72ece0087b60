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
         r"model_type 'llama' \(expected one of \['mixtral', 'qwen2_moe', 'qwen3_moe'\]"),
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
