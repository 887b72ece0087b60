"""Checking a checkpoint against the recipes, and building each parameter where it belongs.

``check_tensors`` compares the checkpoint's headers with what the model needs before anything
is read: a missing or extra tensor, or a wrong shape or dtype, raises ``ValueError`` naming the
tensor with the expected and found values.

``place`` builds one parameter. Without a mesh it is one host array put on the default device.
With a mesh, ``jax.make_array_from_callback`` asks for each addressable device's slice of the
parameter's ``NamedSharding``, and only that slice is made: a routed-expert parameter reads
just the experts in the slice (the checkpoint is memory-mapped, so the others are never read);
any other parameter is assembled once on the host (its sources are few and per layer) and
sliced per device. So no device ever receives a full copy of a sharded parameter, and the host
holds at most one parameter's sources at a time, never the whole model twice.
"""

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.models.hf import safetensors_io, tensor_map

TensorTable = Mapping[str, safetensors_io.TensorInfo]


def check_tensors(recipes: Sequence[tensor_map.Recipe], table: TensorTable) -> None:
    """Checks that the checkpoint has exactly the recipes' tensors, shapes and float dtypes.

    Raises:
      ValueError: a missing tensor, an extra tensor, a shape mismatch or a non-float dtype
        (the first found; the message names the tensor, what was expected and what was found).
    """
    expected = {
        name: shape
        for recipe in recipes
        for name, shape in zip(recipe.sources, recipe.source_shapes, strict=True)
    }
    missing = sorted(set(expected) - set(table))
    if missing:
        raise ValueError(
            f"missing tensor {missing[0]} (expected shape {list(expected[missing[0]])}); "
            f"{len(missing)} missing in all"
        )
    extra = sorted(set(table) - set(expected))
    if extra:
        raise ValueError(
            f"unexpected tensor {extra[0]} (shape {list(table[extra[0]].shape)}) in the "
            f"checkpoint: the config has no parameter for it; {len(extra)} extra in all"
        )
    for name, shape in expected.items():
        info = table[name]
        if info.shape != shape:
            raise ValueError(
                f"tensor {name}: expected shape {list(shape)}, found {list(info.shape)}"
            )
        if info.dtype not in safetensors_io.FLOAT_DTYPES:
            raise ValueError(
                f"tensor {name}: expected a float dtype {safetensors_io.FLOAT_DTYPES}, found "
                f"{info.dtype}"
            )


def _expert_slice(recipe, views, table, index: tuple, dtype) -> np.ndarray:
    """The experts ``index[0]`` of an expert recipe, each cut to ``index[1:]`` first."""
    experts = range(len(recipe.sources) // recipe.per_expert)[index[0]]
    rows = []
    for expert in experts:
        sources = [views.view(table[name]) for name in recipe.expert_sources(expert)]
        rows.append(recipe.to_jtbo(sources)[index[1:]].astype(dtype))
    return np.stack(rows)


def _whole(recipe, views, table, dtype) -> np.ndarray:
    sources = [views.view(table[name]) for name in recipe.sources]
    return np.asarray(recipe.to_jtbo(sources), dtype=dtype)


def place(
    recipe: tensor_map.Recipe,
    views: safetensors_io.FileViews,
    table: TensorTable,
    shape: tuple[int, ...],
    dtype,
    sharding: jax.sharding.Sharding | None,
) -> jax.Array:
    """Builds one parameter (see the module docstring).

    Args:
      recipe: the parameter's recipe.
      views: memory-mapped tensor views.
      table: the checkpoint's tensors (checked with ``check_tensors``).
      shape: the parameter's shape.
      dtype: its dtype.
      sharding: where it goes on the mesh, or None for the default device.

    Returns:
      The parameter as a ``jax.Array``.
    """
    dtype = np.dtype(dtype)
    full_index = tuple(slice(None) for _ in shape)
    if sharding is None:
        if recipe.per_expert:
            return jnp.asarray(_expert_slice(recipe, views, table, full_index, dtype))
        return jnp.asarray(_whole(recipe, views, table, dtype))
    whole: list[np.ndarray] = []  # assembled on first use, shared by every device's slice

    def device_slice(index: tuple) -> np.ndarray:
        index = tuple(index) + full_index[len(index) :]
        if recipe.per_expert:
            return _expert_slice(recipe, views, table, index, dtype)
        if not whole:
            whole.append(_whole(recipe, views, table, dtype))
        return whole[0][index]

    return jax.make_array_from_callback(shape, sharding, device_slice)
