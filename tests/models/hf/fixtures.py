"""The transformers reference fixtures of ``tests/fixtures/hf`` (``tools/make_hf_fixtures.py``),
and the helpers that write checkpoints derived from them (FP8 ones)."""

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from jtbo.models.hf import checkpoint, safetensors_io

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3")


def directory(family: str) -> Path:
    """The fixture's model directory."""
    return ROOT / family


def reference(family: str) -> dict:
    """``reference.json``: prompts, their ids, transformers' greedy tokens, versions."""
    return json.loads((directory(family) / "reference.json").read_text())


def reference_logits(family: str) -> list[np.ndarray]:
    """transformers' float32 logits ``[len(prompt), vocab]`` per prompt."""
    with np.load(directory(family) / "reference_logits.npz") as data:
        return [data[f"prompt_{i}"] for i in range(len(data.files))]


def tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a model directory, as numpy copies."""
    views = safetensors_io.FileViews()
    table = checkpoint.read_tensor_table(directory)
    return {name: np.array(views.view(info)) for name, info in table.items()}


def write_checkpoint(directory: Path, tensors: dict[str, np.ndarray], config: dict) -> None:
    """A new model directory: ``model.safetensors`` of ``tensors`` (FP8 ones as ``F8_E4M3``)
    and ``config.json``."""
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


def quantize_fp8(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``(F8_E4M3 values, float32 scale_inv)`` of an ``[out, in]`` weight: per-block absmax
    scaling to e4m3's range (448), as DeepSeek publishes V3, written out block by block."""
    rows, cols = -(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])
    scale = np.zeros((rows, cols), np.float32)
    q = np.zeros(weight.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = (
                slice(i * block[0], (i + 1) * block[0]),
                slice(j * block[1], (j + 1) * block[1]),
            )
            scale[i, j] = np.abs(weight[part]).max() / 448.0
            q[part] = (weight[part] / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


FP8_MATRICES = ("_proj.weight", "kv_a_proj_with_mqa.weight")
"""Name endings of the matrices an FP8 fixture stores as ``F8_E4M3``: attention, dense MLP,
shared and routed experts."""


def write_fp8_checkpoint(
    directory: Path, block: tuple[int, int], num_layers: int | None = None
) -> dict[str, np.ndarray]:
    """The deepseek_v3 fixture as DeepSeek publishes V3: its ``FP8_MATRICES`` as ``F8_E4M3``
    with ``_scale_inv`` factors per ``block`` of ``[out, in]``, the ``quantization_config``
    in ``config.json``; written to the new ``directory``, cut to its first ``num_layers``
    layers when given.

    Returns:
      The tensors written, by name.
    """
    source = ROOT / "deepseek_v3"
    config = json.loads((source / "config.json").read_text())
    if num_layers is not None:
        config.update(num_hidden_layers=num_layers, num_nextn_predict_layers=0)
    written = {}
    for name, value in tensors(source).items():
        parts = name.split(".")
        if parts[1] == "layers" and int(parts[2]) >= config["num_hidden_layers"]:
            continue
        if name.endswith(FP8_MATRICES):
            written[name], written[name + "_scale_inv"] = quantize_fp8(value, block)
        else:
            written[name] = value
    quantization = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                        weight_block_size=list(block))  # fmt: skip
    write_checkpoint(directory, written, dict(config, quantization_config=quantization))
    return written
