"""A Hugging Face model directory's weights: one ``model.safetensors``, or shards listed by
``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {name: file}}``).

Reading gathers every shard's header into one name -> ``TensorInfo`` table (nothing but the
headers is read); tensors are memory-mapped views (``safetensors_io.FileViews``). Writing
splits the tensors into shards of at most ``max_shard_size`` bytes (a tensor larger than that
gets a shard of its own) and writes the index when there is more than one shard.
"""

import json
from collections.abc import Sequence
from pathlib import Path

from jtbo.models.hf import safetensors_io

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30  # bytes per shard file


def read_tensor_table(directory: Path) -> dict[str, safetensors_io.TensorInfo]:
    """Every tensor of a model directory, by name.

    Args:
      directory: holds ``model.safetensors`` or ``model.safetensors.index.json`` + shards.

    Returns:
      Tensor name -> ``TensorInfo``.

    Raises:
      ValueError: neither file present, an index naming a shard that does not hold the tensor
        it maps, or a tensor present in two shards.
    """
    index_path, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif single.exists():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise ValueError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (safetensors weights)")
    table: dict[str, safetensors_io.TensorInfo] = {}
    for file in files:
        for name, info in safetensors_io.read_header(directory / file).items():
            if name in table:
                raise ValueError(f"tensor {name} is in both {table[name].file} and {info.file}")
            table[name] = info
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in table or table[name].file.name != file:
                raise ValueError(f"{INDEX_FILE} maps tensor {name} to {file}, which lacks it")
    return table


def shard_tensors(
    tensors: Sequence[safetensors_io.PendingTensor], max_shard_size: int
) -> list[list[safetensors_io.PendingTensor]]:
    """Groups tensors, in order, into shards of at most ``max_shard_size`` bytes each."""
    shards: list[list[safetensors_io.PendingTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.num_bytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.num_bytes
    return shards


def write_tensors(
    directory: Path,
    tensors: Sequence[safetensors_io.PendingTensor],
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """Writes tensors as ``model.safetensors`` or as shards with their index.

    Args:
      directory: the (existing) output directory.
      tensors: the tensors, produced one at a time while writing.
      max_shard_size: bytes per shard file.

    Returns:
      The file names written.

    Raises:
      ValueError: ``max_shard_size`` below 1.
    """
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size={max_shard_size} must be >= 1")
    metadata = {"format": "pt"}  # what transformers writes and expects
    shards = shard_tensors(tensors, max_shard_size)
    if len(shards) == 1:
        safetensors_io.write_file(directory / SINGLE_FILE, shards[0], metadata)
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        safetensors_io.write_file(directory / name, shard, metadata)
        weight_map.update({tensor.name: name for tensor in shard})
    total = sum(tensor.num_bytes for tensor in tensors)
    index = dict(metadata=dict(total_size=total), weight_map=weight_map)
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, INDEX_FILE]
