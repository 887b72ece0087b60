"""The routed-expert presets of ``bench grouped_gemm``: one frozen table, checked against the
Hugging Face ``config.json`` files in tools/hf_configs/ (read as jtbo reads a checkpoint's)."""

import dataclasses
import json
import pathlib

import pytest

from jtbo.bench import expert_presets
from jtbo.models import config as config_lib
from jtbo.models.hf import families

HF_CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "tools" / "hf_configs"
PRESET_FILES = {
    "qwen3-30b-a3b": "qwen3_30b_a3b.json",
    "deepseek-v2-lite": "deepseek_v2_lite.json",
    "mixtral-8x7b": "mixtral_8x7b.json",
}
"""The presets whose family's ``config.json`` is in tools/hf_configs/."""
PUBLISHED = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "deepseek-v3": (7168, 2048, 256, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
"""(hidden, ffn, experts, top_k) of each family's published config."""


def _shape(preset: expert_presets.ExpertPreset) -> tuple[int, int, int, int]:
    return preset.hidden, preset.ffn, preset.experts, preset.top_k


def _config_shape(config: config_lib.MoEConfig) -> tuple[int, int, int, int]:
    return (
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
    )


def test_the_table_holds_the_published_shapes_by_name():
    assert {name: _shape(p) for name, p in expert_presets.PRESETS.items()} == PUBLISHED
    assert all(name == preset.name for name, preset in expert_presets.PRESETS.items())


def test_the_table_is_frozen():
    preset = expert_presets.PRESETS["deepseek-v3"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.hidden = 1
    with pytest.raises(TypeError):
        expert_presets.PRESETS["mine"] = preset


@pytest.mark.parametrize("name", sorted(PRESET_FILES))
def test_a_preset_matches_its_family_config_json(name):
    raw = json.loads((HF_CONFIGS / PRESET_FILES[name]).read_text())
    config = families.family_of(raw).to_moe_config(raw)
    assert _shape(expert_presets.PRESETS[name]) == _config_shape(config)


def test_the_deepseek_v3_preset_matches_the_full_model_config():
    preset = expert_presets.PRESETS["deepseek-v3"]
    assert _shape(preset) == _config_shape(config_lib.MoEConfig.deepseek_v3())


def test_shape_flags_name_the_bench_flags():
    preset = expert_presets.PRESETS["mixtral-8x7b"]
    assert preset.shape_flags() == dict(hidden=4096, ffn=14336, experts=8, top_k=2)
