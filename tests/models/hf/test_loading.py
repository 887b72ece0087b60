"""from_pretrained / save_pretrained: exact round trips, sharded placement, malformed
checkpoints (each error names the tensor or field with the expected and found values)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import hf, step
from jtbo.models import model as model_lib
from jtbo.models.hf import checkpoint, safetensors_io
from tests.models.hf import fixtures


def _tensors(directory) -> dict[str, np.ndarray]:
    views = safetensors_io.FileViews()
    table = checkpoint.read_tensor_table(directory)
    return {name: np.array(views.view(info)) for name, info in table.items()}


def _params(model) -> dict:
    _, state = nnx.split(model)
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state)
    }


def _copy(family, tmp_path):
    target = tmp_path / family
    shutil.copytree(fixtures.directory(family), target)
    return target


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_save_pretrained_round_trip_is_exact(family, tmp_path):
    source = fixtures.directory(family)
    model = hf.from_pretrained(source, dtype=jnp.float32)
    hf.save_pretrained(model, tmp_path / "out", max_shard_size=100_000)  # several shards
    assert (tmp_path / "out" / checkpoint.INDEX_FILE).exists()
    original, saved = _tensors(source), _tensors(tmp_path / "out")
    assert sorted(original) == sorted(saved)
    for name, value in original.items():  # bit for bit, in the checkpoint's own layout
        np.testing.assert_array_equal(saved[name].view(np.uint32), value.view(np.uint32), name)
    again = hf.from_pretrained(tmp_path / "out", dtype=jnp.float32)
    assert again.config == model.config
    first, second = _params(model), _params(again)
    assert first.keys() == second.keys()
    for key, value in first.items():
        np.testing.assert_array_equal(second[key], value, key)


def test_save_pretrained_of_a_jtbo_model_and_bfloat16(tmp_path):
    # A model built in jtbo (random weights, bf16) saved as mixtral and loaded back.
    config = config_lib.MoEConfig(
        **dict(config_lib.MoEConfig.tiny_softmax().__dict__, first_k_dense=0, norm_topk_prob=True)
    )
    model = model_lib.cast(model_lib.MoEModel(config, rngs=nnx.Rngs(4)), jnp.bfloat16)
    hf.save_pretrained(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "mixtral" and raw["dtype"] == "bfloat16"
    again = _params(hf.from_pretrained(tmp_path, dtype=jnp.bfloat16))
    for key, value in _params(model).items():
        got = again[key]
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got.view(np.uint16), value.view(np.uint16), key)
    with pytest.raises(ValueError, match=r"qwen3_moe cannot express MoEConfig.qk_norm=False"):
        hf.save_pretrained(model, tmp_path / "q", model_type="qwen3_moe")
    with pytest.raises(ValueError, match=r"no supported family.*scoring_func='sigmoid'"):
        hf.save_pretrained(model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(0)),
                           tmp_path / "d")  # fmt: skip


@pytest.mark.parametrize("backend", ["ep", "none"])
def test_mesh_places_each_shard_and_matches_the_host_load(backend):
    source = fixtures.directory("qwen2_moe")
    mesh = mesh_lib.make_mesh(4, 2)
    placed = hf.from_pretrained(source, dtype=jnp.float32, mesh=mesh, moe_a2a_backend=backend)
    plain = _params(hf.from_pretrained(source, dtype=jnp.float32))
    _, state = nnx.split(placed)
    specs = step.param_specs(state, backend)
    leaves = jax.tree_util.tree_leaves_with_path(state)
    for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs), strict=True):
        assert leaf.sharding == jax.sharding.NamedSharding(mesh, spec), path
        np.testing.assert_array_equal(np.asarray(leaf), plain[jax.tree_util.keystr(path)])
    experts = placed.layers[1].moe.experts.w_gate_up[...]  # [E, H, 2, F]
    shard_shape = experts.addressable_shards[0].data.shape
    want = (1, 32, 2, 16) if backend == "ep" else (8, 32, 2, 2)
    assert shard_shape == want  # no device holds the whole expert stack


def test_checkpoint_errors_name_the_tensor(tmp_path):
    family = "mixtral"
    base = _copy(family, tmp_path)
    tensors = _tensors(base)
    cases = {
        "missing": (
            lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"),
            r"missing tensor model.layers.1.block_sparse_moe.experts.3.w2.weight "
            r"\(expected shape \[32, 24\]\)",
        ),
        "extra": (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.ones(32, np.float32)}),
            r"unexpected tensor model.layers.0.self_attn.q_proj.bias \(shape \[32\]\)",
        ),
        "shape": (
            lambda t: t.update({"model.norm.weight": np.ones(31, np.float32)}),
            r"tensor model.norm.weight: expected shape \[32\], found \[31\]",
        ),
        "dtype": (
            lambda t: t.update({"model.norm.weight": np.ones(32, np.int32)}),
            r"tensor model.norm.weight: expected a float dtype .*found I32",
        ),
    }
    for name, (edit, message) in cases.items():
        broken = dict(tensors)
        edit(broken)
        target = tmp_path / name
        shutil.copytree(base, target)
        pending = [
            safetensors_io.PendingTensor(
                key, _dtype_name(value), value.shape, lambda value=value: value
            )
            for key, value in broken.items()
        ]
        checkpoint.write_tensors(target, pending)
        with pytest.raises(ValueError, match=message):
            hf.from_pretrained(target, dtype=jnp.float32)


def _dtype_name(value: np.ndarray) -> str:
    names = {v: k for k, v in safetensors_io.DTYPES.items()}
    return names[value.dtype]


def test_no_weights_and_no_config(tmp_path):
    target = _copy("qwen3_moe", tmp_path)
    (target / checkpoint.SINGLE_FILE).unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        hf.from_pretrained(target)
    with pytest.raises(ValueError, match="no config.json"):
        hf.from_pretrained(tmp_path / "missing")


def test_save_pretrained_of_a_jtbo_mla_model_picks_deepseek_v3(tmp_path):
    # tiny_mla: sigmoid router with the correction bias, low-rank query, YaRN RoPE.
    model = model_lib.MoEModel(config_lib.MoEConfig.tiny_mla(), rngs=nnx.Rngs(5))
    hf.save_pretrained(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v3" and raw["rope_parameters"]["rope_type"] == "yarn"
    again = hf.from_pretrained(tmp_path, dtype=jnp.float32)
    assert again.config == model.config
    got = _params(again)
    for key, value in _params(model).items():
        np.testing.assert_array_equal(got[key], value, key)
    v2 = config_lib.MoEConfig(
        **dict(config_lib.MoEConfig.tiny_mla().__dict__, scoring_func="softmax",
               topk_method="group_limited_greedy", use_score_correction_bias=False)
    )  # fmt: skip
    hf.save_pretrained(model_lib.MoEModel(v2, rngs=nnx.Rngs(6)), tmp_path / "v2")
    raw = json.loads((tmp_path / "v2" / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v2" and raw["topk_method"] == "group_limited_greedy"
    assert hf.from_pretrained(tmp_path / "v2", dtype=jnp.float32).config == v2
