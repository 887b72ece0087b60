"""Packs a pytree of small host arrays into one int32 buffer, and unpacks it in a jitted step.

Why: a jitted call moves every numpy leaf of its arguments to the devices as its own
host->device transfer. A model step's host plan has 11 leaves without TBO and 28 with it
(token ids, positions, attention tile metadata, DP contexts), and on one H200 those transfers
were a measurable part of a decode step (docs/benchmarks/, "TBO step cost on one H200", fused
weights and one CUDA graph per step, "Host transfers"). So the plan travels as one
buffer per sharding group instead: ``pack`` lays the leaves side by side in
one int32 array on the host, and ``unpack`` cuts them back out inside the jitted program with
static slices, reshapes and bitcasts (no copy worth the name: a few fused slices).

A leaf keeps its leading axes (``lead_axes``: 1 for arrays stacked over DP ranks, so that the
buffer ``[dp, n]`` shards over ``"dp"`` like the leaves did; 0 for replicated values, buffer
``[m]``). The ``PackLayout`` (tree structure, per-leaf shape without the leading axes, dtype)
is static and hashable: it belongs in the compile key. Supported dtypes: every 32-bit one
(int32, uint32, float32: the bits travel unchanged) and bool (as int32 0/1).
"""

import dataclasses
import itertools
import math
from typing import Any

import jax
import numpy as np

WORD = np.dtype(np.int32)
"""The buffer's element type."""


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Where each leaf of a packed pytree lies in its buffer (static; hashable).

    Attributes:
      treedef: the pytree structure.
      shapes: per leaf (flatten order), its shape without the leading axes.
      dtypes: per leaf, its dtype.
      lead_axes: leading axes every leaf shares with the buffer (kept, not packed).
    """

    treedef: jax.tree_util.PyTreeDef
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    lead_axes: int = 0
    # Derived from ``shapes`` (computed once: the host packs every step).
    sizes: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    offsets: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    width: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        """Derives ``sizes`` (words per leaf and leading index: one per element),
        ``offsets`` (each leaf's first word on the buffer's last axis) and ``width`` (the
        buffer's last axis)."""
        sizes = tuple(math.prod(shape) for shape in self.shapes)
        ends = tuple(itertools.accumulate(sizes, initial=0))
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "offsets", ends[:-1])
        object.__setattr__(self, "width", ends[-1])


def packable(dtype: np.dtype) -> bool:
    """Whether ``pack`` takes leaves of ``dtype``: bool or a 32-bit int / uint / float."""
    return dtype == np.bool_ or (dtype.itemsize == WORD.itemsize and dtype.kind in "iuf")


def _leaf_path(tree: Any, index: int) -> str:
    """The key path of leaf ``index`` of ``tree`` (for error messages)."""
    path, _ = jax.tree_util.tree_flatten_with_path(tree)[0][index]
    return jax.tree_util.keystr(path) or "<root>"


def _words(leaf: np.ndarray, lead_shape: tuple[int, ...], size: int) -> np.ndarray:
    """A leaf's ``size`` elements per leading index as int32 words ``[*lead_shape, size]``
    (bits unchanged; bool as 0/1)."""
    flat = leaf.reshape((*lead_shape, size))  # a copy when the leaf is not contiguous
    if flat.dtype == WORD:
        return flat
    if flat.dtype == np.bool_:
        return flat.astype(WORD)
    return np.ascontiguousarray(flat).view(WORD)


def pack(tree: Any, *, lead_axes: int = 0) -> tuple[np.ndarray, PackLayout]:
    """Lays a pytree's array leaves side by side in one int32 host buffer.

    Args:
      tree: a pytree of numpy-convertible arrays (bool or 32-bit dtypes) that all share their
        first ``lead_axes`` dimensions.
      lead_axes: leading dimensions kept as the buffer's leading dimensions (1 for per-DP-rank
        arrays ``[dp, ...]``; 0 for replicated values).

    Returns:
      ``(buffer, layout)``: ``buffer`` is ``[*lead_shape, layout.width]`` int32 (``[m]`` for
      ``lead_axes=0``), leaf ``i`` flattened in row-major order at
      ``[..., layout.offsets[i] : layout.offsets[i] + layout.sizes[i]]``.

    Raises:
      ValueError: a leaf of another dtype (named by its path), a leaf whose leading
        dimensions differ from the first leaf's, a negative ``lead_axes``, or a tree without
        leaves from which to take ``lead_axes > 0`` leading dimensions.
    """
    if lead_axes < 0:
        raise ValueError(f"lead_axes={lead_axes} must be >= 0")
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    if lead_axes and not arrays:
        raise ValueError(f"a tree without leaves has no {lead_axes} leading dimensions")
    lead_shape = arrays[0].shape[:lead_axes] if arrays else ()
    for index, array in enumerate(arrays):
        if not packable(array.dtype):
            raise ValueError(
                f"cannot pack leaf {_leaf_path(tree, index)} of dtype {array.dtype}: only "
                "32-bit dtypes (int32, uint32, float32) and bool are supported"
            )
        if array.shape[:lead_axes] != lead_shape:
            raise ValueError(
                f"leaf {_leaf_path(tree, index)} has shape {array.shape}; every leaf must "
                f"start with the leading dimensions {lead_shape}"
            )
    layout = PackLayout(
        treedef=treedef,
        shapes=tuple(array.shape[lead_axes:] for array in arrays),
        dtypes=tuple(array.dtype for array in arrays),
        lead_axes=lead_axes,
    )
    if not arrays:
        return np.empty((*lead_shape, 0), WORD), layout
    words = [_words(a, lead_shape, size) for a, size in zip(arrays, layout.sizes, strict=True)]
    return np.concatenate(words, axis=-1), layout


def _leaf(words: jax.Array, dtype: np.dtype) -> jax.Array:
    """int32 words back to ``dtype`` (same bits; bool from 0/1)."""
    if dtype == np.bool_:
        return words != 0
    if dtype == WORD:
        return words
    return jax.lax.bitcast_convert_type(words, dtype)


def unpack(buffer: jax.Array, layout: PackLayout) -> Any:
    """Cuts a packed buffer back into its pytree (traceable: static slices and bitcasts).

    Args:
      buffer: ``[*lead_shape, layout.width]`` int32, as ``pack`` made it (or a shard of it
        along the leading dimensions, e.g. one DP rank's ``[1, width]`` in a ``shard_map``).
      layout: the ``PackLayout`` ``pack`` returned.

    Returns:
      The pytree, each leaf ``[*lead_shape, *shape]`` of its original dtype, bit for bit.

    Raises:
      ValueError: a buffer whose dtype, rank or last dimension does not match ``layout``.
    """
    if buffer.dtype != WORD or buffer.ndim != layout.lead_axes + 1:
        raise ValueError(
            f"expected an int32 buffer of rank {layout.lead_axes + 1}, got {buffer.dtype} "
            f"{buffer.shape}"
        )
    if buffer.shape[-1] != layout.width:
        raise ValueError(f"buffer has {buffer.shape[-1]} words per row, layout {layout.width}")
    lead_shape = buffer.shape[:-1]
    leaves = [
        _leaf(buffer[..., start : start + size].reshape((*lead_shape, *shape)), dtype)
        for start, size, shape, dtype in zip(
            layout.offsets, layout.sizes, layout.shapes, layout.dtypes, strict=True
        )
    ]
    return jax.tree.unflatten(layout.treedef, leaves)
