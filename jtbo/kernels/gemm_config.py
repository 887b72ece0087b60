"""Tuning knobs of the grouped expert GEMM kernels (``jtbo.kernels.grouped_gemm``).

One program computes a ``block_m x block_n`` output tile of one expert's rows, looping over
the contraction in steps of ``block_k`` (a loop Triton software-pipelines over ``num_stages``
buffers). Tiles are launched in groups of ``group_m`` row tiles that walk the column tiles
together, so the weight columns a group reads stay in L2 while its row tiles reuse them (the
grouped ordering of Triton's matmul tutorial and of SGLang's ``fused_moe``).

Block sizes are upper bounds: ``fit`` shrinks a block to the largest power of two dividing
the dimension it tiles (contraction and column dimensions must be tiled exactly) and
``rows_block`` shrinks ``block_m`` to a row count (the capacity, or with
``balanced_row_tiles`` the balanced rows per expert: ``grouped_gemm.tile_row_count``) rounded
up to a power of two (at least 16, Triton's smallest matmul tile).

``MosaicFfnConfig`` holds the launch shapes of the ``"mosaic"`` impl's kernels
(``jtbo.kernels.grouped_gemm_mosaic``): each of a CTA's two compute warpgroups computes
``tile_m x tile_n``, the two stacked by rows (a ``2 * tile_m``-row tile, ``tile_n`` columns) or,
with FP8 weights and ``split_columns``, side by side (a ``tile_m``-row tile, ``2 * tile_n``
columns); a 2-CTA cluster takes two neighbouring column tiles.
"""

import dataclasses
import math

from jtbo.core import arith
from jtbo.kernels import launch_checks

MIN_DOT_BLOCK = 16  # Triton's tl.dot needs every tile dimension >= 16
MOSAIC_EPILOGUE_TILE = 64  # rows and columns of one output store of the Mosaic GPU kernels
# Registers a thread of the Mosaic kernels' memory warpgroup keeps: Mosaic GPU's suggestion for
# H100-class GPUs.
MOSAIC_MEMORY_REGISTERS = 40


def dot_tiles(dim: int) -> bool:
    """Whether Triton's power-of-two matmul tiles (>= ``MIN_DOT_BLOCK``) divide ``dim``."""
    return dim % MIN_DOT_BLOCK == 0


def fit(block: int, dim: int) -> int:
    """The largest power of two that is at most ``block`` and divides ``dim``."""
    largest_divisor = dim & -dim  # the lowest set bit: the largest power of two dividing dim
    return min(block, largest_divisor)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Launch shape of one grouped GEMM kernel.

    Attributes:
      block_m: rows per tile (a power of two, >= 16).
      block_n: output columns per tile (a power of two, >= 16).
      block_k: contraction step of the inner loop (a power of two, >= 16).
      group_m: row tiles launched together over all column tiles (>= 1).
      num_warps: warps per program (a power of two).
      num_stages: software-pipelining stages of the contraction loop (>= 1).
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        launch_checks.require_powers_of_two(self, ("block_m", "block_n", "block_k", "num_warps"))
        launch_checks.require_at_least(self, ("block_m", "block_n", "block_k"), MIN_DOT_BLOCK)
        launch_checks.require_at_least(self, ("group_m", "num_stages"), 1)

    def rows_block(self, rows: int) -> int:
        """``block_m``, or less when ``rows`` fit a smaller power of two (>= 16)."""
        return min(self.block_m, arith.power_of_two_at_least(rows, MIN_DOT_BLOCK))

    def describe(self) -> str:
        """Short label for tables: ``MxNxK wW sS gG``."""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} "
            f"s{self.num_stages} g{self.group_m}"
        )


@dataclasses.dataclass(frozen=True)
class GroupedFfnConfig:
    """Launch shapes of the two kernels of the grouped expert FFN.

    Attributes:
      gate_up: the gate / up GEMM with the SiLU-times-up epilogue (contraction over H,
        columns over F; each program keeps a gate and an up accumulator).
      down: the down GEMM (contraction over F, columns over H).
      balanced_row_tiles: size both kernels' row tiles for the balanced load ``max_rows /
        E`` when the call bounds its rows, rather than for the capacity
        (``grouped_gemm.tile_row_count``).
    """

    # The fastest of the shapes swept on one H200 at 4096 tokens (docs/benchmarks/, "The Pallas
    # grouped GEMM (exact counts)"); the gate/up tile is 2 x block_n wide (two accumulators).
    gate_up: GemmConfig = GemmConfig(
        block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3
    )
    down: GemmConfig = GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    balanced_row_tiles: bool = False

    def describe(self) -> str:
        """Short label for tables: ``gate_up <label> / down <label>`` (``, balanced rows``)."""
        rows = ", balanced rows" if self.balanced_row_tiles else ""
        return f"gate_up {self.gate_up.describe()} / down {self.down.describe()}{rows}"


# Default launch shapes (measured: see GroupedFfnConfig).
GROUPED_FFN = GroupedFfnConfig()
# Default launch shapes of FP8 weights: a contraction step of a whole 128-wide FP8 block moves
# as many bytes per step as the float kernels' 64-wide bf16 steps; fastest of those measured
# at decode sizes (docs/benchmarks/, "FP8 experts stored contraction-last, with FP8
# activations"). Row tiles follow the balanced load: the FP8 dot runs slower on tiles of
# many rows, and at 128-1024 tokens tiles sized for the capacity ran mostly empty
# (docs/benchmarks/, "Grouped GEMM kernels at Qwen3-30B-A3B's expert shape"). The float
# kernels keep capacity-sized tiles: balanced ones were as fast at decode sizes and slower at
# 1024 tokens there.
GROUPED_FFN_FP8 = GroupedFfnConfig(
    gate_up=GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    down=GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    balanced_row_tiles=True,
)


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig:
    """Launch shape of one Mosaic GPU grouped GEMM.

    Attributes:
      tile_m: rows per compute warpgroup (64 at least, ``wgmma``'s ``M``); a row tile
        (``block_m``) is ``2 * tile_m`` rows, or ``tile_m`` with ``split_columns``.
      tile_n: output columns per compute warpgroup (the gate / up kernel: per accumulator);
        a CTA's column tile (``block_n``) is ``tile_n`` wide, or ``2 * tile_n`` with
        ``split_columns``.
      tile_k: contraction step of one pipeline stage.
      max_concurrent_steps: pipeline stages in flight (shared-memory buffers per operand).
      grid_tile_width: row tiles walked together over the column tiles (L2 reuse of the
        weight columns, ``plgpu.planar_snake``).
      wgmma_in_flight: contraction steps whose ``wgmma`` may still run when a warpgroup
        issues the next step's (0 or 1; their stage buffers are released that many steps
        later). The FP8 kernels read each step's product, so they take 0 only.
      prefetch_across_tiles: one pipeline runs over all of a CTA's tiles, so the memory
        warpgroup loads the next tile's first stages while the compute warpgroups finish the
        current tile (a pipeline of pipelines; with ``wgmma_in_flight`` the compute
        warpgroups release each step's buffers themselves). Needs a number of contraction
        steps that ``max_concurrent_steps`` divides.
      memory_registers: registers a thread of the memory warpgroup keeps (``setmaxnreg``); the
        two compute warpgroups share the rest of the register file (232 each at 40). A
        multiple of 8 in ``[24, 256]``.
      split_columns: the two compute warpgroups take the two ``tile_n``-column halves of a
        CTA's column tile over the same ``tile_m`` rows, rather than two row halves (the FP8
        kernels only). Per weight byte a CTA then loads half the row bytes and computes half
        the rows: at decode sizes, where an expert's few rows are mostly padding, that is
        padding neither loaded nor multiplied; at prefill sizes it is fewer products per
        weight byte.
    """

    tile_m: int = 64
    tile_n: int = 256
    tile_k: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 4
    wgmma_in_flight: int = 0
    prefetch_across_tiles: bool = False
    memory_registers: int = MOSAIC_MEMORY_REGISTERS
    split_columns: bool = False

    def __post_init__(self):
        launch_checks.require_powers_of_two(self, ("tile_m", "tile_n", "tile_k"))
        launch_checks.require_at_least(self, ("tile_m", "tile_n", "tile_k"), MOSAIC_EPILOGUE_TILE)
        launch_checks.require_at_least(self, ("max_concurrent_steps", "grid_tile_width"), 1)
        if self.wgmma_in_flight not in (0, 1):
            raise ValueError(f"wgmma_in_flight must be 0 or 1, got {self.wgmma_in_flight}")
        if self.max_concurrent_steps <= self.wgmma_in_flight:
            raise ValueError(
                f"max_concurrent_steps ({self.max_concurrent_steps}) must exceed "
                f"wgmma_in_flight ({self.wgmma_in_flight}): a step in flight holds its buffers"
            )
        if self.memory_registers % 8 or not 24 <= self.memory_registers <= 256:
            raise ValueError(
                f"memory_registers must be a multiple of 8 in [24, 256] (setmaxnreg), got "
                f"{self.memory_registers}"
            )

    @property
    def block_m(self) -> int:
        """Rows of one row tile (a CTA's tile): both compute warpgroups' rows, or with
        ``split_columns`` the ``tile_m`` rows they share."""
        return self.tile_m if self.split_columns else 2 * self.tile_m

    @property
    def block_n(self) -> int:
        """Columns of one column tile (a CTA's tile; the gate / up kernel: per accumulator):
        ``tile_n``, each compute warpgroup computing all of them, or with ``split_columns``
        ``2 * tile_n``, a half each."""
        return 2 * self.tile_n if self.split_columns else self.tile_n

    def describe(self) -> str:
        """Short label for tables: ``MxNxK sS tT [fF] [p] [c] [rR]`` (M x N a CTA's tile, F the
        steps in flight when not 0, ``p`` when the pipeline prefetches across tiles, ``c`` when
        the warpgroups split the columns, R the memory warpgroup's registers when not the
        default)."""
        in_flight = f" f{self.wgmma_in_flight}" if self.wgmma_in_flight else ""
        prefetch = " p" if self.prefetch_across_tiles else ""
        split = " c" if self.split_columns else ""
        registers = self.memory_registers
        registers = f" r{registers}" if registers != MOSAIC_MEMORY_REGISTERS else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.tile_k} s{self.max_concurrent_steps} "
            f"t{self.grid_tile_width}{in_flight}{prefetch}{split}{registers}"
        )


@dataclasses.dataclass(frozen=True)
class MosaicFfnConfig:
    """Launch shapes of the two Mosaic GPU kernels of the grouped FFN.

    Attributes:
      gate_up: the gate / up GEMM (two accumulators of ``tile_m x tile_n`` per warpgroup).
      down: the down GEMM.
    """

    gate_up: MosaicGemmConfig = MosaicGemmConfig(tile_n=128, wgmma_in_flight=1)
    down: MosaicGemmConfig = MosaicGemmConfig(tile_n=256, wgmma_in_flight=1)

    def __post_init__(self):
        if self.gate_up.block_m != self.down.block_m:
            raise ValueError(
                f"both kernels tile the same rows: block_m {self.gate_up.block_m} != "
                f"{self.down.block_m}"
            )

    def describe(self) -> str:
        """Short label for tables: ``gate_up <label> / down <label>``."""
        return f"mosaic gate_up {self.gate_up.describe()} / down {self.down.describe()}"


# Default Mosaic GPU launch shapes: the 2-CTA-cluster, two-warpgroup shape of the fastest
# dense Mosaic GPU matmul measured, with 128-row tiles; the swept variants were not faster
# (docs/benchmarks/, "Mosaic GPU against cuBLAS" and "the grouped FFN on Mosaic GPU"). A
# step's wgmma stays in flight while the next is issued: side by side the layer ran faster
# so at every prefill size measured (docs/benchmarks/, "left in flight in the bf16 Mosaic kernels").
MOSAIC_FFN = MosaicFfnConfig()


# Mosaic GPU launch shapes of FP8 weights with FP8 activations, each tile's pipeline waited
# (the default, ``mosaic_ffn_fp8``, builds on them per expert shape): a contraction step of
# one 128-deep weight block (128 FP8 bytes, the widest swizzle) and a column tile of one
# 128-wide block, so that each partial product takes one weight scale and each gate / up
# tile row is one quantization group of the hidden rows.
MOSAIC_FFN_FP8 = MosaicFfnConfig(
    gate_up=MosaicGemmConfig(tile_n=128, tile_k=128),
    down=MosaicGemmConfig(tile_n=128, tile_k=128),
)


# Registers a thread of the FP8 default's gate / up memory warpgroup keeps. At the default 40,
# ptxas spills that warpgroup's registers in the FP8 gate / up kernel (its pipeline carries two
# weight operands and their scales); 88 leaves the compute warpgroups 208 each, enough for
# their accumulators, and the layer ran faster so at every preset measured (docs/benchmarks/,
# "the FP8 gate / up memory warpgroup's registers").
MOSAIC_FP8_GATE_UP_MEMORY_REGISTERS = 88

# The FP8 default splits the columns between the warpgroups (``split_columns``, 64-row tiles)
# up to this many rows an expert on average: there most of an expert's rows fit one 64-row
# tile, so each weight byte comes with half the row bytes and half the padded products of a
# 128-row tile. The decode layer ran faster so up to this load and slower at twice it, where
# many experts take a second tile that reads their weights again (docs/benchmarks/, "the
# warpgroups splitting the columns at decode").
MOSAIC_FP8_SPLIT_MAX_ROWS_PER_EXPERT = 32
# The split gate / up kernel's stages: 72 KB each (a 64-row block and two 256-column weight
# tiles), so three do not fit beside the epilogue's shared memory.
_SPLIT_GATE_UP_STAGES = 2


def mosaic_ffn_fp8(hidden: int, ffn: int, rows_per_expert: float = math.inf) -> MosaicFfnConfig:
    """The default FP8 launch shapes for experts of ``hidden`` x ``ffn``: ``MOSAIC_FFN_FP8``
    with each kernel's pipeline running across its tiles (``prefetch_across_tiles``), at the
    most stages, up to ``MOSAIC_FFN_FP8``'s, that divide its contraction steps (``hidden``
    for gate / up, ``ffn`` for down, over ``tile_k``). A kernel whose steps no count of two
    stages or more divides (DeepSeek-V2-Lite's 11 down steps) keeps the waited pipeline. The
    gate / up kernel's memory warpgroup keeps ``MOSAIC_FP8_GATE_UP_MEMORY_REGISTERS``.

    Up to ``MOSAIC_FP8_SPLIT_MAX_ROWS_PER_EXPERT`` rows an expert, where both widths split
    into 256-column tiles, the warpgroups split the columns (``split_columns``: 64-row
    tiles), the gate / up kernel in ``_SPLIT_GATE_UP_STAGES`` stages at most.

    Prefetching hides each tile's pipeline fill, a large part of a tile of few contraction
    steps such as the down kernel's (docs/benchmarks/, "FP8 prefetching at prefill").

    Args:
      hidden: the experts' model width (the gate / up contraction).
      ffn: the experts' intermediate width (the down contraction).
      rows_per_expert: the call's rows over its experts (its average load; unbounded by
        default).

    Returns:
      The ``MosaicFfnConfig``.
    """
    gate_up, down = MOSAIC_FFN_FP8.gate_up, MOSAIC_FFN_FP8.down
    split_width = 2 * MOSAIC_FFN_FP8.down.tile_n
    if rows_per_expert <= MOSAIC_FP8_SPLIT_MAX_ROWS_PER_EXPERT and not (
        hidden % split_width or ffn % split_width
    ):
        gate_up = dataclasses.replace(
            gate_up, split_columns=True, max_concurrent_steps=_SPLIT_GATE_UP_STAGES
        )
        down = dataclasses.replace(down, split_columns=True)
    return MosaicFfnConfig(
        gate_up=dataclasses.replace(
            _prefetching(gate_up, hidden), memory_registers=MOSAIC_FP8_GATE_UP_MEMORY_REGISTERS
        ),
        down=_prefetching(down, ffn),
    )


def default_mosaic_ffn(
    hidden: int, ffn: int, fp8: bool, rows_per_expert: float = math.inf
) -> MosaicFfnConfig:
    """The Mosaic kernels' default launch shapes for experts of ``hidden`` x ``ffn``:
    ``mosaic_ffn_fp8(hidden, ffn, rows_per_expert)`` for FP8 weights, ``MOSAIC_FFN`` for
    float ones.

    Args:
      hidden: the experts' model width.
      ffn: the experts' intermediate width.
      fp8: whether the weights are block-scaled FP8.
      rows_per_expert: the call's rows over its experts (unbounded by default).

    Returns:
      The ``MosaicFfnConfig``.
    """
    return mosaic_ffn_fp8(hidden, ffn, rows_per_expert) if fp8 else MOSAIC_FFN


def _prefetching(cfg: MosaicGemmConfig, contraction: int) -> MosaicGemmConfig:
    """``cfg`` prefetching across tiles at the most stages (2 to its own) that divide the
    ``contraction // tile_k`` steps; ``cfg`` itself where none does."""
    steps = contraction // cfg.tile_k
    for stages in range(cfg.max_concurrent_steps, 1, -1):
        if steps % stages == 0:
            return dataclasses.replace(cfg, prefetch_across_tiles=True, max_concurrent_steps=stages)
    return cfg
