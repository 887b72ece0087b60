"""Row-copy kernels of DP attention and two-batch overlap.

* ``dp_memcpy``: SGLang's DP memcpy, rows to or from a traced row offset.
* ``slice_pad``: a TBO child's rows sliced out of the parent into a zero buffer.
* ``merge_rows``: TBO children's rows written back at their parent offsets.
* ``grouped_ffn``: the routed experts' SwiGLU over exactly each expert's filled capacity
  slots (a grouped GEMM; tuning knobs in ``GroupedFfnConfig``), given as a slot buffer or
  as ``SlotRows`` (rows and one row index per slot, loaded through the index);
  ``grouped_ffn_rows`` leaves the ``"mosaic"`` impl's result in its own rows (``SlotRows``).
  Its weights may be block-scaled FP8 (``jtbo.kernels.fp8_blocks.BlockQuantized``), read as
  FP8 by the ``"pallas"`` kernels (FP8 or float rows) and the ``"mosaic"`` ones (FP8 rows).

Each op takes ``impl`` (``"xla"``, ``"pallas"``, ``"triton"`` or None for the fastest
available; ``grouped_ffn`` also ``"mosaic"``, its Hopper kernels) and ``config`` (a
``CopyConfig``; launch shapes for ``grouped_ffn``). All impls share one out-of-range rule
(``jtbo.kernels.ranges``): rows that do not exist in a buffer are never read or
written, and nothing is shifted to fit.
"""

from jtbo.kernels.copy_config import CopyConfig
from jtbo.kernels.gemm_config import (
    GemmConfig,
    GroupedFfnConfig,
    MosaicFfnConfig,
    MosaicGemmConfig,
)
from jtbo.kernels.grouped_gemm import grouped_ffn, grouped_ffn_rows
from jtbo.kernels.impls import IMPLS, KernelUnavailableError
from jtbo.kernels.memcpy import dp_memcpy
from jtbo.kernels.merge import merge_rows
from jtbo.kernels.slice_pad import slice_pad
from jtbo.kernels.slot_rows import SlotRows

__all__ = [
    "IMPLS",
    "CopyConfig",
    "GemmConfig",
    "GroupedFfnConfig",
    "KernelUnavailableError",
    "MosaicFfnConfig",
    "MosaicGemmConfig",
    "SlotRows",
    "dp_memcpy",
    "grouped_ffn",
    "grouped_ffn_rows",
    "merge_rows",
    "slice_pad",
]
