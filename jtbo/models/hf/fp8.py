"""Dequantizing DeepSeek-V3's FP8 block-quantized checkpoints while they are read.

DeepSeek-V3 publishes its linear weights as ``float8_e4m3fn`` (safetensors ``F8_E4M3``), each
with a ``<name>_scale_inv`` companion: one float32 factor per ``weight_block_size`` block
(``[128, 128]``) of the ``[out, in]`` weight, the last blocks of a dimension possibly shorter.
The real weight is ``fp8 value * factor`` of its block (``config.json``'s
``quantization_config``: ``quant_method: fp8``, ``fmt: e4m3``). jtbo serves in bf16 / float32,
so a quantized tensor is presented to the loader as a float32 tensor of the weight's shape,
dequantized when its recipe reads it; the ``_scale_inv`` tensors disappear from the table.
Activations are not quantized (``activation_scheme: dynamic`` concerns FP8 matmuls, which
jtbo does not run), so results are those of the bf16 conversion of the checkpoint.
"""

import dataclasses

import numpy as np

from jtbo.core import arith
from jtbo.models.hf import safetensors_io

SCALE_SUFFIX = "_scale_inv"
"""Suffix of a quantized weight's per-block factors (``<weight name>_scale_inv``)."""


@dataclasses.dataclass(frozen=True)
class QuantizedTensorInfo(safetensors_io.TensorInfo):
    """A quantized weight as the loader sees it: float32, the weight's shape.

    Attributes:
      weight: the stored ``F8_E4M3`` tensor.
      scale: its ``[ceil(out / block), ceil(in / block)]`` float32 factors.
      block: ``weight_block_size`` (rows, columns).
    """

    weight: safetensors_io.TensorInfo | None = None
    scale: safetensors_io.TensorInfo | None = None
    block: tuple[int, int] = (128, 128)


def block_size(quantization: dict) -> tuple[int, int]:
    """Checks a ``quantization_config`` and returns its ``weight_block_size``.

    Raises:
      ValueError: anything but FP8 e4m3 with 2-D weight blocks (names the field).
    """
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"unsupported config field quantization_config.quant_method={method!r} (expected 'fp8')"
        )
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(
            f"unsupported config field quantization_config.fmt={fmt!r} (expected 'e4m3')"
        )
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(b > 0 for b in block)):
        raise ValueError(
            f"unsupported config field quantization_config.weight_block_size={block!r} "
            "(expected two positive sizes, e.g. [128, 128])"
        )
    return int(block[0]), int(block[1])


def dequantizing_table(table: dict, block: tuple[int, int]) -> dict:
    """The table with every quantized weight replaced by a ``QuantizedTensorInfo``.

    Args:
      table: the checkpoint's tensors by name.
      block: ``weight_block_size``.

    Returns:
      Name -> info, without the ``_scale_inv`` tensors.

    Raises:
      ValueError: an ``F8_E4M3`` tensor without its factors, factors without their weight, or
        factors of the wrong shape (names the tensor, expected and found).
    """
    out = {}
    for name, info in table.items():
        if name.endswith(SCALE_SUFFIX):
            if name[: -len(SCALE_SUFFIX)] not in table:
                raise ValueError(f"tensor {name} has no weight {name[: -len(SCALE_SUFFIX)]}")
            continue
        scale = table.get(name + SCALE_SUFFIX)
        if info.dtype != "F8_E4M3":
            if scale is not None:
                raise ValueError(f"tensor {name} has {SCALE_SUFFIX} factors but dtype {info.dtype}")
            out[name] = info
            continue
        if scale is None:
            raise ValueError(f"FP8 tensor {name} has no {name + SCALE_SUFFIX} factors")
        expected = tuple(arith.ceil_div(size, b) for size, b in zip(info.shape, block, strict=True))
        if scale.shape != expected:
            raise ValueError(
                f"tensor {name + SCALE_SUFFIX}: expected shape {list(expected)} for blocks "
                f"{list(block)} of {list(info.shape)}, found {list(scale.shape)}"
            )
        out[name] = QuantizedTensorInfo(
            info.file, "F32", info.shape, info.begin, info.end, info, scale, block
        )
    return out


def dequantize(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``weight * factor`` of each element's block, in float32.

    Args:
      weight: ``[out, in]`` FP8 values.
      scale: ``[ceil(out / block[0]), ceil(in / block[1])]`` factors.
      block: block rows and columns.

    Returns:
      ``[out, in]`` float32.
    """
    rows, cols = weight.shape
    factors = np.repeat(np.repeat(scale.astype(np.float32), block[0], 0), block[1], 1)
    return weight.astype(np.float32) * factors[:rows, :cols]


class DequantizingViews:
    """``FileViews`` that dequantize ``QuantizedTensorInfo`` tensors when they are viewed."""

    def __init__(self, views: safetensors_io.FileViews):
        """Args: views: the memory-mapped views of the checkpoint's files."""
        self._views = views

    def view(self, info: safetensors_io.TensorInfo) -> np.ndarray:
        """The tensor, dequantized to float32 if it is a quantized weight."""
        if isinstance(info, QuantizedTensorInfo):
            return dequantize(
                self._views.view(info.weight), self._views.view(info.scale), info.block
            )
        return self._views.view(info)
