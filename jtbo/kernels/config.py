"""Tuning knobs of the Pallas and jax-triton copy kernels.

All three ops stream a flat element range in blocks of ``block_elems`` per
program. The starts of those ranges are whole rows, so an address is a multiple of
``gcd(row_elems, vector_bytes // itemsize)`` elements; the kernels pass that as an
alignment hint so Triton can issue ``vector_bytes``-wide loads and stores although
the offsets are traced. The defaults below were tuned on the H200 (see BENCHMARKS.md).
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class CopyConfig:
    """Launch shape of one copy kernel.

    Attributes:
      block_elems: elements moved per program (a power of two, at least 16).
      num_warps: warps per program.
      num_stages: software-pipelining stages Triton may use.
      vector_bytes: widest access the alignment hint promises (power of two, <= 16).
      xla_below_bytes: ``impl=None`` picks ``"xla"`` when the largest possible copy is at
        most this many bytes (there a kernel's extra launches cost more than they save).
    """

    block_elems: int = 4096
    num_warps: int = 16
    num_stages: int = 1
    vector_bytes: int = 16
    xla_below_bytes: int = 0

    def __post_init__(self):
        for name in ("block_elems", "num_warps", "vector_bytes"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"CopyConfig.{name} must be a power of two, got {value}")
        if self.block_elems < 16:
            raise ValueError(f"CopyConfig.block_elems must be >= 16, got {self.block_elems}")
        if self.vector_bytes > 16:
            raise ValueError(f"CopyConfig.vector_bytes must be <= 16, got {self.vector_bytes}")
        if self.xla_below_bytes < 0:
            raise ValueError(f"CopyConfig.xla_below_bytes must be >= 0, got {self.xla_below_bytes}")
        if self.num_stages < 1:
            raise ValueError(f"CopyConfig.num_stages must be >= 1, got {self.num_stages}")

    def align(self, row_elems: int, itemsize: int) -> int:
        """Elements every row start is a multiple of, capped at one vector."""
        return math.gcd(max(row_elems, 1), max(self.vector_bytes // itemsize, 1))


# H200, bf16, 256 MiB (BENCHMARKS.md): 4096 elements x 16 warps was the best triton
# config for dp_memcpy and merge_rows and level with the best for slice_pad. At 1 MiB
# XLA's fused scatter beat both kernels on dp_memcpy(dst at offset), hence the cut-over.
DP_MEMCPY = CopyConfig(xla_below_bytes=1 << 20)
SLICE_PAD = CopyConfig()
MERGE_ROWS = CopyConfig()
