"""Rows gathered into row tiles, dead tiles skipped (the input of the Mosaic grouped GEMM).

``gather_tiles(rows, source, tile_expert, tile_rows)`` returns ``out [num_tiles * tile_rows,
H]`` with ``out[i] = rows[source[i]]`` (zero where ``source[i] < 0``) for every row of a live
tile (``tile_expert[t] >= 0``); the rows of a dead tile are not written (undefined), since no
kernel reads them. XLA's gather writes every output row; a bound on the live tiles leaves
many dead ones (a TBO step's micro-batch buckets, a skewed routing), and each of their rows
costs a full row's write.

Kernel (``impl="pallas"``, Pallas with the Triton lowering; the Pallas interpreter on the
CPU): one program per (block of ``block_rows`` rows, block of ``block_cols`` columns); a
program whose tile is dead returns after reading its tile's expert; a live one loads its
rows' source indices and the source rows' columns (masked: an empty slot loads zeros) and
stores them. ``gather_tiles_reference`` is the XLA gather (every row written).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.kernels import gemm_config, impls, launch_checks, slot_rows


@dataclasses.dataclass(frozen=True)
class TileGatherConfig:
    """Launch shape of ``gather_tiles``.

    Attributes:
      block_rows: rows per program (a power of two dividing the tile's rows).
      block_cols: columns per program (an upper bound: the largest power of two dividing H).
      num_warps: warps per program.
    """

    block_rows: int = 32
    block_cols: int = 256
    num_warps: int = 4

    def __post_init__(self):
        launch_checks.require_powers_of_two(self, ("block_rows", "block_cols", "num_warps"))


# Default launch shape (the one measured in the Mosaic layer: docs/benchmarks/, "The gather
# into row tiles").
TILE_GATHER = TileGatherConfig()


def _gather_kernel(tile_expert_ref, source_ref, rows_ref, out_ref, *, block_rows, block_cols,
                   tile_rows):  # fmt: skip
    # tile_expert_ref: [num_tiles] int32 (-1 dead); source_ref: [num_tiles * tile_rows] int32
    # row of rows_ref per output row (-1 zero); rows_ref: [N, H]; out_ref: [num_tiles *
    # tile_rows, H].
    first = pl.program_id(0) * block_rows
    first_col = pl.program_id(1) * block_cols

    @pl.when(tile_expert_ref[first // tile_rows] >= 0)
    def _copy():
        source = source_ref[pl.ds(first, block_rows)]
        present = jnp.broadcast_to((source >= 0)[:, None], (block_rows, block_cols))
        columns = first_col + jnp.arange(block_cols, dtype=jnp.int32)
        # Both axes indexed by arrays: the Pallas interpreter cannot mix an array and a slice.
        view = rows_ref.at[jnp.maximum(source, 0)[:, None], columns[None, :]]
        values = plgpu.load(view, mask=present, other=0)
        out_ref[pl.ds(first, block_rows), pl.ds(first_col, block_cols)] = values


def gather_tiles_pallas(rows, source, tile_expert, tile_rows: int, cfg, interpret: bool):
    """Pallas impl (arguments as ``gather_tiles``)."""
    hidden = rows.shape[1]
    block_rows = min(cfg.block_rows, tile_rows)
    block_cols = gemm_config.fit(cfg.block_cols, hidden)
    if tile_rows % block_rows:
        raise ValueError(f"block_rows {block_rows} must divide the tile's {tile_rows} rows")
    kernel = functools.partial(
        _gather_kernel, block_rows=block_rows, block_cols=block_cols, tile_rows=tile_rows
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((source.shape[0], hidden), rows.dtype),
        grid=(source.shape[0] // block_rows, hidden // block_cols),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
    )(tile_expert, source, rows)


def gather_tiles(
    rows: jax.Array,
    source: jax.Array,
    tile_expert: jax.Array,
    tile_rows: int,
    *,
    impl: str | None = None,
    config: TileGatherConfig | None = None,
) -> jax.Array:
    """The rows of every live tile, each row ``rows[source[i]]`` (zero for ``source[i] < 0``).

    Args:
      rows: ``[N, H]`` source rows.
      source: ``[num_tiles * tile_rows]`` int32 row of ``rows`` per output row, or -1.
      tile_expert: ``[num_tiles]`` int32, -1 for a dead tile (its rows are not written).
      tile_rows: rows per tile.
      impl: ``"xla"`` (a gather of every row), ``"pallas"`` or None (the fastest here).
      config: the kernel's launch shape; None for ``TILE_GATHER``.

    Returns:
      ``[num_tiles * tile_rows, H]`` in ``rows.dtype``; a dead tile's rows undefined with the
      Pallas impl (zero or gathered with the XLA one).

    Raises:
      ValueError: shapes that do not fit together, an unknown impl.
      KernelUnavailableError: the impl cannot run here.
    """
    if rows.ndim != 2 or source.shape != (tile_expert.shape[0] * tile_rows,):
        raise ValueError(
            f"rows [N, H] and source [num_tiles * {tile_rows}] expected, got {rows.shape} and "
            f"{source.shape} for {tile_expert.shape[0]} tiles"
        )
    impl = impls.resolve(impl, op="gather_tiles")
    if impl == "triton":
        raise impls.KernelUnavailableError("gather_tiles has no impl='triton'; use 'pallas'")
    if impl == "xla" or rows.size == 0 or source.size == 0:
        return gather_tiles_reference(rows, source)
    return gather_tiles_pallas(
        rows, source, tile_expert, tile_rows, config or TILE_GATHER, impls.backend() == "cpu"
    )


def gather_tiles_reference(rows: jax.Array, source: jax.Array) -> jax.Array:
    """XLA impl and reference: every output row gathered (zero where ``source < 0``)."""
    return slot_rows.gather_rows(rows, source)
