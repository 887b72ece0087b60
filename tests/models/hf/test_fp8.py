"""DeepSeek-V3 FP8 block-quantized checkpoints: dequantized while loading, block by block, or
with ``expert_dtype="float8_e4m3fn"`` their routed experts kept FP8.

The deepseek_v3 fixture's projection weights are quantized here to ``F8_E4M3`` with one factor
per 8 x 8 block (ragged last blocks: 20 and 48 rows do not divide by 8 x 3), as DeepSeek
publishes V3 with 128 x 128 blocks. The FP8 load must equal a float32 load of the same
weights dequantized block by block with explicit loops. With FP8 experts, their values and
factors must be the stored bytes, each matrix kept ``[out, in]`` (the experts' stored order,
``fp8_blocks.expert_axes``; non-square blocks, so a transposed block order shows), and stand
for the checkpoint's matrices dequantized by the loops; a float checkpoint's experts are
quantized as ``fp8_blocks``' block-by-block definition does.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.kernels import fp8_blocks
from jtbo.models import experts as experts_lib
from jtbo.models import hf, step
from tests.models.hf import fixtures

BLOCK = (8, 8)


def _dequantized_by_loops(q: np.ndarray, scale: np.ndarray, block=BLOCK) -> np.ndarray:
    out = np.zeros(q.shape, np.float32)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = np.float32(q[r, c]) * scale[r // block[0], c // block[1]]
    return out


def _quantized_checkpoint(tmp_path, block=BLOCK):
    fp8 = fixtures.write_fp8_checkpoint(tmp_path / "fp8", block)
    config = json.loads((fixtures.directory("deepseek_v3") / "config.json").read_text())
    plain = {
        name: _dequantized_by_loops(value, fp8[name + "_scale_inv"], block)
        if name + "_scale_inv" in fp8
        else value
        for name, value in fp8.items()
        if not name.endswith("_scale_inv")
    }
    fixtures.write_checkpoint(tmp_path / "plain", plain, config)
    return tmp_path / "fp8", tmp_path / "plain", fp8


def _params(model) -> dict:
    _, state = nnx.split(model)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree.leaves_with_path(state)}


def test_fp8_checkpoint_loads_as_its_blockwise_dequantization(tmp_path):
    fp8_dir, plain_dir, tensors = _quantized_checkpoint(tmp_path)
    assert sum(name.endswith("_scale_inv") for name in tensors) > 20
    got = _params(hf.from_pretrained(fp8_dir, dtype=np.float32))
    want = _params(hf.from_pretrained(plain_dir, dtype=np.float32))
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, key)
    # The dequantized weights are close to the original ones (e4m3: 3 mantissa bits).
    original = _params(hf.from_pretrained(fixtures.directory("deepseek_v3"), dtype=np.float32))
    key = next(k for k in want if "wkv_b" in k)
    np.testing.assert_allclose(got[key], original[key], rtol=0.07, atol=1e-3)


def test_fp8_errors_name_the_tensor(tmp_path):
    fp8_dir, _, tensors = _quantized_checkpoint(tmp_path)
    config = json.loads((fp8_dir / "config.json").read_text())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    missing = {k: v for k, v in tensors.items() if k != name + "_scale_inv"}
    fixtures.write_checkpoint(tmp_path / "missing", missing, config)
    with pytest.raises(ValueError, match=f"FP8 tensor {name} has no {name}_scale_inv"):
        hf.from_pretrained(tmp_path / "missing", dtype=np.float32)
    wrong = dict(tensors, **{name + "_scale_inv": np.ones((3, 3), np.float32)})
    fixtures.write_checkpoint(tmp_path / "wrong", wrong, config)
    with pytest.raises(ValueError, match=r"expected shape \[8, 2\] .* found \[3, 3\]"):
        hf.from_pretrained(tmp_path / "wrong", dtype=np.float32)
    other = dict(config, quantization_config=dict(quant_method="awq"))
    shutil.rmtree(tmp_path / "wrong")
    fixtures.write_checkpoint(tmp_path / "wrong", tensors, other)
    with pytest.raises(ValueError, match="quant_method='awq' \\(expected 'fp8'\\)"):
        hf.from_pretrained(tmp_path / "wrong", dtype=np.float32)


FP8 = "float8_e4m3fn"
EXPERTS = "model.layers.{layer}.mlp.experts.{expert}.{name}.weight"


def _expert_matrices(tensors, layer, expert, suffix=""):
    """``(gate, up, down)`` of one routed expert in the checkpoint, each ``[out, in]``."""
    return [
        tensors[EXPERTS.format(layer=layer, expert=expert, name=name) + suffix]
        for name in ("gate_proj", "up_proj", "down_proj")
    ]


def _stored_as(got, hf_matrix) -> None:
    """``got`` is ``hf_matrix`` bit for bit (FP8 experts keep each matrix ``[out, in]``)."""
    got, want = np.ascontiguousarray(np.asarray(got)), np.ascontiguousarray(hf_matrix)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_fp8_experts_stay_fp8_as_stored(tmp_path):
    # [out, in] blocks of 4 x 8: jtbo's (contraction, output) block is (8, 4).
    fp8_dir, _, tensors = _quantized_checkpoint(tmp_path, (4, 8))
    model = hf.from_pretrained(fp8_dir, dtype=np.float32, expert_dtype=FP8)
    assert (model.config.expert_dtype, model.config.expert_block_size) == (FP8, (8, 4))
    weight_only = hf.from_pretrained(
        fp8_dir, dtype=np.float32, expert_dtype=FP8, expert_fp8_activations=False
    )
    assert model.layers[1].moe.experts.activation_groups == (8, 8)  # FP8 rows by default
    assert not weight_only.config.expert_fp8_activations
    assert weight_only.layers[1].moe.experts.activation_groups is None
    for layer in (1, 2):
        experts = model.layers[layer].moe.experts
        assert experts.w_gate_up[...].dtype == experts.w_down[...].dtype == jnp.float8_e4m3fn
        # Stored contraction-last: [E, 2, F, H] and [E, H, F], the checkpoint's [out, in].
        assert experts.w_gate_up[...].shape == (8, 2, 16, 32)
        assert experts.w_gate_up_scale[...].shape == (8, 2, 4, 4)  # [E, 2, F / 4, H / 8]
        assert experts.w_down_scale[...].shape == (8, 8, 2)  # [E, H / 4, F / 8]
        for e in range(model.config.num_experts):
            gate, up, down = _expert_matrices(tensors, layer, e)
            scales = _expert_matrices(tensors, layer, e, "_scale_inv")
            for got, want in zip(
                (experts.w_gate_up[e, 0], experts.w_gate_up[e, 1], experts.w_down[e]),
                (gate, up, down), strict=True,
            ):  # fmt: skip
                _stored_as(got, want)
            for got, want in zip(
                (experts.w_gate_up_scale[e, 0], experts.w_gate_up_scale[e, 1],
                 experts.w_down_scale[e]), scales, strict=True,
            ):  # fmt: skip
                _stored_as(got, want)
        # The weights they stand for ([E, H, 2, F], [E, F, H]): each matrix dequantized by
        # loops, transposed.
        gate_up, down = experts_lib.float_weights(experts.weights, jnp.float32)
        for got, matrix, scale in zip(
            (gate_up[:, :, 1], down),
            _expert_matrices(tensors, layer, 3)[1:],
            _expert_matrices(tensors, layer, 3, "_scale_inv")[1:], strict=True,
        ):  # fmt: skip
            want = _dequantized_by_loops(matrix, scale, (4, 8)).T
            np.testing.assert_array_equal(np.asarray(got[3]), want)
    # Everything else is the dequantizing load's.
    plain = _params(hf.from_pretrained(fp8_dir, dtype=np.float32))
    got = _params(model)
    assert sum("experts" in key for key in got) == 8  # values and scales, two layers
    for key, value in plain.items():
        if "experts" not in key:
            np.testing.assert_array_equal(got[key], value, key)


# "ep": one expert per device; "none": every expert's F = 16 split in two, whole 8 x 8 blocks.
@pytest.mark.parametrize(
    ("backend", "devices", "scale_shard"),
    [("ep", 8, (1, 2, 2, 4)), ("none", 2, (8, 2, 1, 4))],  # [E, 2, F, H] blocks
)
def test_fp8_experts_on_a_mesh_are_the_host_load_sharded(tmp_path, backend, devices, scale_shard):
    fp8_dir, _, _ = _quantized_checkpoint(tmp_path)
    mesh = mesh_lib.make_mesh(devices, 1)
    placed = hf.from_pretrained(
        fp8_dir, dtype=np.float32, mesh=mesh, moe_a2a_backend=backend, expert_dtype=FP8
    )
    host = _params(hf.from_pretrained(fp8_dir, dtype=np.float32, expert_dtype=FP8))
    _, state = nnx.split(placed)
    specs = jax.tree.leaves(step.param_specs(state, backend))
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(state), specs, strict=True):
        assert leaf.sharding == jax.sharding.NamedSharding(mesh, spec), path
        want = host[jax.tree_util.keystr(path)]
        np.testing.assert_array_equal(np.asarray(leaf).view(np.uint8), want.view(np.uint8))
    scales = placed.layers[1].moe.experts.w_gate_up_scale[...]
    assert scales.addressable_shards[0].data.shape == scale_shard


def test_float_checkpoint_experts_are_quantized_while_loading():
    # H = 32 and F = 16 in 128 x 128 blocks: one ragged block per matrix.
    source = fixtures.directory("deepseek_v3")
    model = hf.from_pretrained(source, dtype=np.float32, expert_dtype=FP8)
    assert model.config.expert_block_size == (128, 128)
    tensors = fixtures.tensors(source)
    experts = model.layers[2].moe.experts
    assert experts.w_down_scale[...].shape == (8, 1, 1)
    for e in (0, 5):
        gate, _, down = _expert_matrices(tensors, 2, e)
        for matrix, values, scales in (
            (gate, experts.w_gate_up[e, 0], experts.w_gate_up_scale[e, 0]),
            (down, experts.w_down[e], experts.w_down_scale[e]),
        ):
            want_values, want_scales = fp8_blocks.quantize_blocks_reference(matrix, (128, 128))
            _stored_as(values, want_values)
            _stored_as(scales, want_scales)
    # The same bits as quantizing the float load's experts in the graph, stored
    # contraction-last.
    floats = hf.from_pretrained(source, dtype=np.float32).layers[2].moe.experts
    block_shape = fp8_blocks.expert_block_shape(4, (128, 128))
    in_graph = fp8_blocks.quantize_blocks(
        floats.w_gate_up[...], block_shape, axes=fp8_blocks.expert_axes(4)
    )
    np.testing.assert_array_equal(
        np.asarray(in_graph.values).view(np.uint8),
        np.asarray(experts.w_gate_up[...]).view(np.uint8),
    )
    np.testing.assert_array_equal(in_graph.scales, experts.w_gate_up_scale[...])


def test_expert_dtype_errors(tmp_path):
    source = fixtures.directory("deepseek_v3")
    same = hf.from_pretrained(source, dtype=np.float32, expert_dtype="float32")
    assert same.config.expert_dtype is None
    for wrong in ("int8", "bfloat16", "no-such-dtype"):
        with pytest.raises(ValueError, match=f"expert_dtype='{wrong}': expected None, 'float32'"):
            hf.from_pretrained(source, dtype=np.float32, expert_dtype=wrong)
    with pytest.raises(ValueError, match="moe_intermediate_size=16 over 8 devices"):
        hf.from_pretrained(source, mesh=mesh_lib.make_mesh(8, 1), moe_a2a_backend="none",
                           expert_dtype=FP8)  # fmt: skip
    model = hf.from_pretrained(source, dtype=np.float32, expert_dtype=FP8)
    with pytest.raises(ValueError, match="expert_dtype='float8_e4m3fn'"):
        hf.save_pretrained(model, tmp_path / "out")
