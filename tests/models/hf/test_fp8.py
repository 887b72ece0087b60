"""DeepSeek-V3 FP8 block-quantized checkpoints: dequantized while loading, block by block.

The deepseek_v3 fixture's projection weights are quantized here to ``F8_E4M3`` with one factor
per 8 x 8 block (ragged last blocks: 20 and 48 rows do not divide by 8 x 3), as DeepSeek
publishes V3 with 128 x 128 blocks. The FP8 load must equal a float32 load of the same
weights dequantized block by block with explicit loops.
"""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jtbo.models import hf
from jtbo.models.hf import checkpoint, safetensors_io
from tests.models.hf import fixtures

BLOCK = (8, 8)
QUANTIZED = ("_proj.weight", "kv_a_proj_with_mqa.weight")  # attention, MLP and expert matrices


def _tensors(directory) -> dict[str, np.ndarray]:
    views = safetensors_io.FileViews()
    return {n: np.array(views.view(i)) for n, i in checkpoint.read_tensor_table(directory).items()}


def _quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block absmax scaling to e4m3's range (448), as DeepSeek's FP8 weights."""
    rows, cols = -(-weight.shape[0] // BLOCK[0]), -(-weight.shape[1] // BLOCK[1])
    scale = np.zeros((rows, cols), np.float32)
    q = np.zeros(weight.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = (
                slice(i * BLOCK[0], (i + 1) * BLOCK[0]),
                slice(j * BLOCK[1], (j + 1) * BLOCK[1]),
            )
            scale[i, j] = np.abs(weight[part]).max() / 448.0
            q[part] = (weight[part] / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def _dequantized_by_loops(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    out = np.zeros(q.shape, np.float32)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = np.float32(q[r, c]) * scale[r // BLOCK[0], c // BLOCK[1]]
    return out


def _write(directory, tensors: dict[str, np.ndarray], config: dict) -> None:
    directory.mkdir()
    pending = [
        safetensors_io.PendingTensor(
            name, next(k for k, v in safetensors_io.DTYPES.items() if v == a.dtype), a.shape,
            lambda a=a: a,
        )
        for name, a in tensors.items()
    ]  # fmt: skip
    safetensors_io.write_file(directory / checkpoint.SINGLE_FILE, pending, {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))


def _quantized_checkpoint(tmp_path):
    source = fixtures.directory("deepseek_v3")
    config = json.loads((source / "config.json").read_text())
    tensors, plain, fp8 = _tensors(source), {}, {}
    for name, value in tensors.items():
        if name.endswith(QUANTIZED) and "embed" not in name:
            q, scale = _quantize(value)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            plain[name] = _dequantized_by_loops(q, scale)
        else:
            fp8[name] = plain[name] = value
    quantization = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                        weight_block_size=list(BLOCK))  # fmt: skip
    _write(tmp_path / "fp8", fp8, dict(config, quantization_config=quantization))
    _write(tmp_path / "plain", plain, config)
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
    _write(tmp_path / "missing", missing, config)
    with pytest.raises(ValueError, match=f"FP8 tensor {name} has no {name}_scale_inv"):
        hf.from_pretrained(tmp_path / "missing", dtype=np.float32)
    wrong = dict(tensors, **{name + "_scale_inv": np.ones((3, 3), np.float32)})
    _write(tmp_path / "wrong", wrong, config)
    with pytest.raises(ValueError, match=r"expected shape \[8, 2\] .* found \[3, 3\]"):
        hf.from_pretrained(tmp_path / "wrong", dtype=np.float32)
    other = dict(config, quantization_config=dict(quant_method="awq"))
    shutil.rmtree(tmp_path / "wrong")
    _write(tmp_path / "wrong", tensors, other)
    with pytest.raises(ValueError, match="quant_method='awq' \\(expected 'fp8'\\)"):
        hf.from_pretrained(tmp_path / "wrong", dtype=np.float32)
