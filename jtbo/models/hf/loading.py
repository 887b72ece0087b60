"""``from_pretrained`` / ``save_pretrained``: a Hugging Face model directory <-> ``MoEModel``.

Loading reads ``config.json`` (``families`` maps it to a ``MoEConfig``), the safetensors
headers (``checkpoint``), checks every tensor against the model's recipes (``tensor_map``,
``placement.check_tensors``) and only then builds the parameters one at a time, each straight
into its place (``placement.place``; sharded by ``jtbo.models.param_specs`` when a mesh is
given), into the state of an abstract ``MoEModel`` (``nnx.eval_shape``: no random weights are
drawn). Saving writes the same layout back: ``config.json`` of the family and the tensors,
one parameter's worth at a time, as ``model.safetensors`` or shards with their index.
"""

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo.models import config as config_lib
from jtbo.models import experts, step
from jtbo.models import model as model_lib
from jtbo.models.hf import (
    checkpoint,
    families,
    fp8,
    fp8_experts,
    placement,
    safetensors_io,
    tensor_map,
)


def _state_path(path) -> tuple:
    """A state leaf's key path as plain keys, e.g. ``("layers", 0, "attn", "wqkv")``."""
    return tuple(key.key for key in path if isinstance(key, jax.tree_util.DictKey))


def _read_config(path: str | os.PathLike) -> tuple[families.Family, dict]:
    """The family and the raw ``config.json`` of a model directory.

    Raises:
      ValueError: no ``config.json``, one that is not a JSON object, or an unsupported
        ``model_type``.
    """
    config_path = Path(path) / "config.json"
    if not config_path.exists():
        raise ValueError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(raw).__name__}")
    return families.family_of(raw), raw


def read_config(path: str | os.PathLike) -> config_lib.MoEConfig:
    """The ``MoEConfig`` of a model directory's ``config.json``, without reading its weights.

    Args:
      path: the model directory.

    Returns:
      The mapped config (what ``from_pretrained(path).config`` will be).

    Raises:
      ValueError: as ``from_pretrained`` for the config file and its fields.
    """
    family, raw = _read_config(path)
    return family.to_moe_config(raw)


def _tensor_table(path: Path, family: families.Family, raw: dict):
    """``(table, views, file_views)``: the checkpoint's tensors by name (FP8 tensors as the
    float32 tensors they dequantize to, their ``_scale_inv`` factors folded in), views that
    read them so, and the views of the stored tensors."""
    table = checkpoint.read_tensor_table(path)
    table = {name: info for name, info in table.items() if not family.skipped_tensor(name, raw)}
    file_views = views = safetensors_io.FileViews()
    if raw.get("quantization_config") is not None:  # FP8 blocks, dequantized as they are read
        table = fp8.dequantizing_table(table, fp8.block_size(raw["quantization_config"]))
        views = fp8.DequantizingViews(file_views)
    return table, views, file_views


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype=jnp.bfloat16,
    mesh: jax.sharding.Mesh | None = None,
    moe_a2a_backend: str = "ep",
    expert_dtype=None,
    expert_fp8_activations: bool = True,
) -> model_lib.MoEModel:
    """Loads a Hugging Face MoE checkpoint (``qwen3_moe``, ``qwen2_moe``, ``mixtral``,
    ``deepseek_v2``, ``deepseek_v3``; ``jtbo.models.hf.families``).

    Args:
      path: the model directory (``config.json`` and ``model.safetensors``, or shards with
        ``model.safetensors.index.json``).
      dtype: the parameters' dtype.
      mesh: a ``("dp", "attn_tp")`` mesh to place the parameters on, sharded as the step
        shards them (``jtbo.models.param_specs``); None: the default device.
      moe_a2a_backend: with a mesh, the MoE backend whose expert sharding to use ("ep":
        whole experts per device, "none": every expert's hidden width split).
      expert_dtype: the routed experts' storage: None (or ``dtype``'s name), as the other
        parameters; ``"float8_e4m3fn"``, block-scaled FP8 (``MoEConfig.expert_dtype``): an
        FP8 checkpoint's expert values and scales are kept as stored, a float checkpoint's
        experts are quantized in 128 x 128 blocks while they load (``fp8_experts``).
      expert_fp8_activations: ``MoEConfig.expert_fp8_activations`` of FP8 experts.

    Returns:
      The ``MoEModel`` (``model.config`` is the mapped ``MoEConfig``).

    Raises:
      ValueError: a missing or malformed ``config.json`` (naming the file), an unsupported
        ``model_type`` or config field, a missing or extra tensor or one of the wrong shape or
        dtype (each named with the expected and found values), no weights in the directory,
        an unknown ``expert_dtype``, or FP8 expert blocks that a device's shard would cut.
    """
    family, raw = _read_config(path)
    config = _load_config(family, raw, dtype, expert_dtype, expert_fp8_activations)
    if mesh is not None:
        experts.check_expert_shards(config, moe_a2a_backend, mesh.size)
    table, views, file_views = _tensor_table(Path(path), family, raw)
    plans = _plans(config, family, table, (views, file_views), dtype)
    abstract = nnx.eval_shape(lambda: model_lib.MoEModel(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)

    def build(key_path, leaf, spec=None):
        sharding = None if mesh is None else jax.sharding.NamedSharding(mesh, spec)
        recipe, recipe_views, recipe_dtype = plans.pop(_state_path(key_path))
        return placement.place(recipe, recipe_views, table, leaf.shape, recipe_dtype, sharding)

    if mesh is None:
        state = jax.tree_util.tree_map_with_path(build, state)
    else:
        specs = step.param_specs(state, moe_a2a_backend)
        state = jax.tree_util.tree_map_with_path(build, state, specs)
    if plans:
        raise AssertionError(f"recipes without a model parameter: {sorted(plans)}")
    return nnx.merge(graphdef, state)


def _plans(config, family, table, views: tuple, dtype) -> dict:
    """Parameter path -> ``(recipe, its views, dtype)`` of every parameter, the FP8 experts'
    from ``fp8_experts.plans``; ``views = (float views, file views)``.

    Raises:
      ValueError: a missing or extra tensor, or one of the wrong shape (``check_tensors``).
    """
    float_views, file_views = views
    recipes = tensor_map.recipes(config, family)
    placement.check_tensors(recipes, table)
    plans = {recipe.path: (recipe, float_views, dtype) for recipe in recipes}
    if config.expert_dtype is not None:
        plans.update(fp8_experts.plans(config, family, file_views, float_views))
    return plans


def _load_config(family, raw: dict, dtype, expert_dtype, expert_fp8_activations: bool):
    """The ``MoEConfig`` a load builds: the family's mapping of ``raw`` with the asked expert
    storage (``fp8_experts.model_config``) and FP8 scheme."""
    config = fp8_experts.model_config(family.to_moe_config(raw), raw, expert_dtype, dtype)
    return dataclasses.replace(config, expert_fp8_activations=expert_fp8_activations)


def _pending(recipe: tensor_map.Recipe, value: jax.Array) -> list[safetensors_io.PendingTensor]:
    """The checkpoint tensors of one parameter, written in order: the parameter is copied to
    the host for its first tensor and dropped after its last, so the host holds one parameter
    at a time."""
    dtype = safetensors_io.dtype_name(value.dtype)
    host: list[np.ndarray] = []

    def produce(position: int):
        def produce_one() -> np.ndarray:
            if not host:
                host.append(np.asarray(value))
            if recipe.per_expert:
                row, offset = divmod(position, recipe.per_expert)
                tensor = recipe.to_hf(host[0][row])[offset]
            else:
                tensor = recipe.to_hf(host[0])[position]
            if position == len(recipe.sources) - 1:
                host.clear()
            return tensor

        return produce_one

    return [
        safetensors_io.PendingTensor(name, dtype, shape, produce(position))
        for position, (name, shape) in enumerate(
            zip(recipe.sources, recipe.source_shapes, strict=True)
        )
    ]


def save_pretrained(
    model: model_lib.MoEModel,
    path: str | os.PathLike,
    *,
    model_type: str | None = None,
    max_shard_size: int = checkpoint.DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Writes ``model`` as a Hugging Face model directory that ``from_pretrained`` (and
    transformers) load back exactly.

    Args:
      model: the model (parameters anywhere: host, one device, or sharded on a mesh).
      path: the output directory (created if needed; existing files of the same names are
        replaced).
      model_type: the family to write; None picks the one that can express ``model.config``.
      max_shard_size: bytes per safetensors file; more than one file adds the index.

    Raises:
      ValueError: an unknown ``model_type``, a config the family cannot express (names the
        ``MoEConfig`` field), or FP8 routed experts.
    """
    config = model.config
    if config.expert_dtype is not None:
        raise ValueError(
            f"save_pretrained writes float weights; this model's routed experts are "
            f"MoEConfig.expert_dtype={config.expert_dtype!r}: save the model loaded without "
            "expert_dtype"
        )
    if model_type is None:
        family = families.family_for(config)
    else:
        family = families.family_of(dict(model_type=model_type))
    raw = family.to_hf_config(config)
    _, state = nnx.split(model)
    leaves = dict(
        (_state_path(key_path), leaf)
        for key_path, leaf in jax.tree_util.tree_leaves_with_path(state)
    )
    tensors = []
    for recipe in tensor_map.recipes(config, family):
        tensors += _pending(recipe, leaves[recipe.path])
    raw["dtype"] = jnp.dtype(leaves[("embed", "table")].dtype).name
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint.write_tensors(directory, tensors, max_shard_size)
    (directory / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
