"""Tuning knobs of the Pallas and jax-triton copy kernels.

All three ops stream a flat element range in blocks of ``block_elems`` per
program. The starts of those ranges are whole rows, so an address is a multiple of
``gcd(row_elems, vector_bytes // itemsize)`` elements; the kernels pass that as an
alignment hint so Triton can issue ``vector_bytes``-wide loads and stores although
the offsets are traced.

Why large blocks: each program first loads its offset and size scalars (one memory
round trip in which it moves no data), then its block. With one 16-byte vector per
thread a program spends about half its life waiting on those scalars; a block of
several vectors per thread keeps more bytes in flight per round trip. A small copy,
though, needs enough programs to reach every SM, so ``block_for`` halves the block
until the grid has ``min_programs`` programs (never below one vector per thread).
"""

import dataclasses
import math

from jtbo.core import arith
from jtbo.kernels import launch_checks

EVICTION_POLICIES = (None, "evict_first", "evict_last")


@dataclasses.dataclass(frozen=True)
class CopyConfig:
    """Launch shape of one copy kernel.

    Attributes:
      block_elems: elements moved per program at most (a power of two, at least 16).
      num_warps: warps per program (a power of two).
      num_stages: software-pipelining stages Triton may use.
      vector_bytes: widest access the alignment hint promises (power of two, <= 16).
      min_programs: ``block_for`` halves the block until the grid has at least this many
        programs or the block is one vector per thread (0 keeps ``block_elems``).
      eviction_policy: cache hint on the streamed loads (None, "evict_first" or
        "evict_last"); the data are read once, so "evict_first" spares L2 for the stores.
      xla_below_bytes: ``impl=None`` picks ``"xla"`` when the largest possible copy is at
        most this many bytes (there a kernel's launch costs more than it saves).
    """

    block_elems: int = 16384
    num_warps: int = 16
    num_stages: int = 1
    vector_bytes: int = 16
    min_programs: int = 528
    eviction_policy: str | None = None
    xla_below_bytes: int = 0

    def __post_init__(self):
        launch_checks.require_powers_of_two(self, ("block_elems", "num_warps", "vector_bytes"))
        launch_checks.require_at_least(self, ("block_elems",), 16)
        if self.vector_bytes > 16:
            raise ValueError(f"CopyConfig.vector_bytes must be <= 16, got {self.vector_bytes}")
        launch_checks.require_at_least(self, ("xla_below_bytes", "min_programs"), 0)
        launch_checks.require_at_least(self, ("num_stages",), 1)
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"CopyConfig.eviction_policy must be one of {EVICTION_POLICIES}, "
                f"got {self.eviction_policy!r}"
            )

    def align(self, row_elems: int, itemsize: int) -> int:
        """Elements every row start is a multiple of, capped at one vector."""
        return math.gcd(max(row_elems, 1), max(self.vector_bytes // itemsize, 1))

    def block_for(self, total_elems: int, itemsize: int) -> int:
        """Block size for a grid over ``total_elems`` elements (see the module docstring)."""
        vector_elems = max(self.vector_bytes // itemsize, 1)
        floor = min(self.block_elems, self.num_warps * 32 * vector_elems)
        block = self.block_elems
        while block > floor and arith.ceil_div(total_elems, block) < self.min_programs:
            block //= 2
        return block

    def describe(self) -> str:
        """Short label for tables: ``block x warps`` plus the non-default knobs."""
        label = f"{self.block_elems} x {self.num_warps}w"
        if self.num_stages != 1:
            label += f" stages={self.num_stages}"
        if self.eviction_policy:
            label += f" {self.eviction_policy}"
        return label


# The best configs of the H200 sweep at 256 MiB (docs/benchmarks/, "Kernels: the copy
# kernels", config sweep).
# block_for shrinks blocks for small copies.
DP_MEMCPY = CopyConfig(block_elems=4096, num_warps=16)
SLICE_PAD = CopyConfig(block_elems=4096, num_warps=16)
MERGE_ROWS = CopyConfig(block_elems=8192, num_warps=16)
