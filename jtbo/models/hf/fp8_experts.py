"""Routed experts built as FP8 while a checkpoint loads (``from_pretrained(expert_dtype=...)``).

FP8 routed experts (``MoEConfig.expert_dtype="float8_e4m3fn"``) hold each expert's gate, up
and down matrices as ``float8_e4m3fn`` values and a float32 scale per block
(``jtbo.kernels.fp8_blocks``), stored contraction-last (``fp8_blocks.expert_axes``):
``w_gate_up [E, 2, F, H]``, ``w_down [E, H, F]``, i.e. each matrix ``[out, in]`` as a
checkpoint stores it, its ``(out, in)`` blocks being jtbo's ``(contraction, output)`` blocks
(``expert_block_size``) transposed. So these parameters come from the recipes that keep each
matrix as it is and only stack them (``tensor_map.out_in_expert_recipes``), and one recipe
maps a matrix's values and its block scales alike: the values parameter (``w_gate_up``,
``w_down``) is made from each source matrix's FP8 values, and the scale parameter
(``w_gate_up_scale``, ``w_down_scale``) from its scales by the same recipe with the scales'
shapes (``plans``).

Where each source matrix's values and scales come from (``ValueViews``, ``ScaleViews``):

* an FP8 matrix of the checkpoint (``fp8.QuantizedTensorInfo``) in the model's blocks: its
  stored values and ``_scale_inv`` factors, bit for bit, never dequantized;
* any other (a bf16 / float32 checkpoint, or FP8 in other blocks, dequantized first): the
  float matrix quantized as it is read, in the model's blocks (``fp8_blocks``' host
  functions). A scale parameter computes only the block maxima, so such a matrix is read
  once for its values and once for its scales; a device still reads only its own experts.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from jtbo.kernels import fp8_blocks
from jtbo.models import config as config_lib
from jtbo.models.hf import families, fp8, safetensors_io, tensor_map

FP8 = "float8_e4m3fn"
"""The ``expert_dtype`` of FP8 routed experts."""
SCALE_SUFFIX = "_scale"
"""A values parameter's name plus this is its scale parameter's (``w_down_scale``)."""


def model_config(
    config: config_lib.MoEConfig, raw: dict, expert_dtype, dtype
) -> config_lib.MoEConfig:
    """The config of a load asked for ``expert_dtype``.

    Args:
      config: the checkpoint's mapped config.
      raw: its ``config.json``.
      expert_dtype: None or ``dtype``'s name (the experts as the other parameters), or
        ``"float8_e4m3fn"`` (FP8 experts in the checkpoint's ``weight_block_size`` when it
        has one, else 128 x 128).
      dtype: the load's parameter dtype.

    Returns:
      ``config``, with ``expert_dtype`` and ``expert_block_size`` set for FP8 experts.

    Raises:
      ValueError: another ``expert_dtype``, or an unsupported ``quantization_config``.
    """
    dtype_name = jnp.dtype(dtype).name
    name = expert_dtype
    if expert_dtype is not None and not isinstance(expert_dtype, str):
        name = jnp.dtype(expert_dtype).name  # a dtype object
    if config_lib.resolve_expert_dtype(name, dtype_name) is None:
        return config
    block = fp8_blocks.DEFAULT_BLOCK
    if raw.get("quantization_config") is not None:
        rows, cols = fp8.block_size(raw["quantization_config"])  # blocks of [out, in]
        block = (cols, rows)
    return dataclasses.replace(config, expert_dtype=FP8, expert_block_size=block)


class _FP8Views:
    """Views of source matrices as FP8 parts, in ``[out, in]`` blocks ``hf_block``."""

    def __init__(self, file_views, float_views, hf_block: tuple[int, int]):
        """Args: file_views: the checkpoint's stored tensors (``FileViews``); float_views:
        the same as float (FP8 tensors dequantized); hf_block: ``(out, in)`` block."""
        self._file, self._float, self._block = file_views, float_views, hf_block

    def _stored(self, info: safetensors_io.TensorInfo) -> bool:
        """Whether ``info`` is an FP8 matrix stored in the model's blocks."""
        return isinstance(info, fp8.QuantizedTensorInfo) and tuple(info.block) == self._block


class ValueViews(_FP8Views):
    """Each source matrix as its ``float8_e4m3fn`` values (module docstring)."""

    def view(self, info: safetensors_io.TensorInfo) -> np.ndarray:
        """The matrix's FP8 values, ``[out, in]``."""
        if self._stored(info):
            return self._file.view(info.weight)
        values, _ = fp8_blocks.quantize_blocks_host(self._float.view(info), self._block)
        return values


class ScaleViews(_FP8Views):
    """Each source matrix as its float32 block scales (module docstring)."""

    def view(self, info: safetensors_io.TensorInfo) -> np.ndarray:
        """The matrix's scales, ``[ceil(out / block), ceil(in / block)]``."""
        if self._stored(info):
            return self._file.view(info.scale)
        return fp8_blocks.block_scales_host(self._float.view(info), self._block)


def plans(
    config: config_lib.MoEConfig, family: families.Family, file_views, float_views
) -> dict[tuple, tuple]:
    """How to build the FP8 expert parameters: ``{path: (recipe, views, dtype)}`` of each
    routed-expert values parameter and of its scale parameter, in their stored order.

    Args:
      config: the model's config (FP8 experts in ``expert_block_size`` blocks).
      family: the checkpoint family.
      file_views: the checkpoint's stored tensors.
      float_views: the same, FP8 tensors dequantized.

    Returns:
      Parameter path -> ``(recipe, views, dtype)`` for ``placement.place``.
    """
    block = config.expert_block_size
    hf_block = (block[1], block[0])
    values = ValueViews(file_views, float_views, hf_block)
    scales = ScaleViews(file_views, float_views, hf_block)
    out = {}
    for recipe in tensor_map.out_in_expert_recipes(config, family):
        scale_recipe = dataclasses.replace(
            recipe,
            path=(*recipe.path[:-1], recipe.path[-1] + SCALE_SUFFIX),
            source_shapes=tuple(
                fp8_blocks.scales_shape(shape, hf_block) for shape in recipe.source_shapes
            ),
        )
        out[recipe.path] = (recipe, values, jnp.float8_e4m3fn)
        out[scale_recipe.path] = (scale_recipe, scales, jnp.float32)
    return out
