"""Reading and writing the safetensors format with numpy (no torch, no copy of the file).

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets
relative to the end of the header), then the raw little-endian tensor bytes. Reading maps the
file with ``np.memmap`` and hands out views, so a tensor's bytes are read from disk only when
(and as far as) they are used: slicing a view reads only the slice's pages, and nothing holds
the whole file in memory. Writing streams one tensor at a time after a header computed from
the tensors' shapes and dtypes.
"""

import dataclasses
import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # DeepSeek-V3's FP8 weights (``fp8``)
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
"""safetensors dtype name -> numpy dtype, for the dtypes this reader can map."""
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
"""The dtypes a model weight may have."""
_HEADER_ALIGN = 8  # the header is padded with spaces so that the data starts 8-byte aligned


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives.

    Attributes:
      file: the safetensors file.
      dtype: safetensors dtype name (``"BF16"``, ``"F32"``, ...).
      shape: the tensor's shape.
      begin: offset of its first byte from the start of the file.
      end: offset one past its last byte.
    """

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parses a safetensors file's header.

    Args:
      path: the file.

    Returns:
      Tensor name -> ``TensorInfo`` (the ``__metadata__`` entry is left out).

    Raises:
      ValueError: a file too short for its header, or a header that is not valid JSON.
    """
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: {len(prefix)} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        raw = handle.read(length)
    if len(raw) != length:
        raise ValueError(f"{path}: header of {length} bytes announced, {len(raw)} present")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: the safetensors header is not JSON ({error})") from error
    start = 8 + length
    return {
        name: TensorInfo(
            file=Path(path),
            dtype=entry["dtype"],
            shape=tuple(entry["shape"]),
            begin=start + entry["data_offsets"][0],
            end=start + entry["data_offsets"][1],
        )
        for name, entry in header.items()
        if name != "__metadata__"
    }


class FileViews:
    """Memory-mapped views of tensors, one ``np.memmap`` per file (opened on first use)."""

    def __init__(self):
        self._maps: dict[Path, np.memmap] = {}

    def view(self, info: TensorInfo) -> np.ndarray:
        """The tensor as a read-only numpy view of the mapped file.

        Raises:
          ValueError: a dtype this reader does not know, or a byte range that does not match
            the shape.
        """
        if info.dtype not in DTYPES:
            raise ValueError(f"{info.file}: dtype {info.dtype} is not supported by this reader")
        dtype = DTYPES[info.dtype]
        size = int(np.prod(info.shape, dtype=np.int64)) * dtype.itemsize
        if info.end - info.begin != size:
            raise ValueError(
                f"{info.file}: {info.end - info.begin} bytes for shape {list(info.shape)} "
                f"{info.dtype} (expected {size})"
            )
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        data = self._maps[info.file][info.begin : info.end]
        return data.view(dtype).reshape(info.shape)


@dataclasses.dataclass(frozen=True)
class PendingTensor:
    """A tensor to write: its header entry now, its bytes when ``produce()`` is called.

    Attributes:
      name: tensor name.
      dtype: safetensors dtype name.
      shape: its shape.
      produce: returns the array (``shape``, the numpy dtype of ``dtype``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]

    @property
    def num_bytes(self) -> int:
        """Bytes of its data."""
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype].itemsize


def dtype_name(dtype) -> str:
    """The safetensors name of a numpy / jax float dtype.

    Raises:
      ValueError: a dtype that is not one of ``FLOAT_DTYPES``.
    """
    wanted = np.dtype(dtype)
    for name in FLOAT_DTYPES:
        if DTYPES[name] == wanted:
            return name
    raise ValueError(f"dtype {wanted} cannot be saved (expected one of {FLOAT_DTYPES})")


def write_file(path: Path, tensors: Iterable[PendingTensor], metadata: dict | None) -> None:
    """Writes tensors to one safetensors file, producing and writing one at a time.

    Raises:
      ValueError: a produced array whose shape or dtype differs from its header entry.
    """
    tensors = list(tensors)
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for tensor in tensors:
        header[tensor.name] = dict(
            dtype=tensor.dtype, shape=list(tensor.shape),
            data_offsets=[offset, offset + tensor.num_bytes],
        )  # fmt: skip
        offset += tensor.num_bytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _HEADER_ALIGN)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for tensor in tensors:
            array = np.ascontiguousarray(tensor.produce())
            if array.shape != tensor.shape or array.dtype != DTYPES[tensor.dtype]:
                raise ValueError(
                    f"{tensor.name}: produced {array.shape} {array.dtype}, header says "
                    f"{tensor.shape} {tensor.dtype}"
                )
            handle.write(array.tobytes())
