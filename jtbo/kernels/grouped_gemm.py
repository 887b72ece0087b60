"""Routed-expert SwiGLU FFN over exactly each expert's rows (a grouped GEMM).

``grouped_ffn(x_slots, counts, w_gate_up, w_down)`` computes, for every expert ``e`` and each
of its first ``counts[e]`` slots, ``(silu(x @ gate_e) * (x @ up_e)) @ down_e``; slots at or past
``counts[e]`` are not read and come out zero. ``x_slots [E, C, H]`` is the capacity-slot layout
the dense EP all-to-all produces: expert ``e``'s rows fill its first slots, the rest is padding
(zeros), so a batched matmul over all ``C`` slots computes every padding row too (at the EP
capacity factor of 4, four times the useful rows).

Kernel (``impl="pallas"``, Pallas with the Triton lowering; the Pallas interpreter on the CPU):
the rows are seen as one flat ``[E * C, H]`` array and the work as a list of *row tiles*, each
``block_m`` rows of one expert: expert ``e`` contributes ``ceil(counts[e] / block_m)`` tiles
starting at row ``e * C``, live tiles first; a tile past the live ones has expert -1. Each
program finds its tile's expert and rows itself from the counts (``_tile_rows``: a running
sum of the experts' tiles, a few vector operations over ``E`` values), so no XLA pass
builds a tile table before the kernels (``tile_table.row_tiles`` is the same table in XLA).
``num_tiles`` is static: every tile possible, or fewer when the caller bounds the total rows
(``max_rows``), which keeps the grid near the useful work. With such a bound and
``balanced_row_tiles`` (the FP8 default) ``block_m`` is sized for the balanced load
``max_rows / E`` rather than the capacity (``tile_row_count``): at decode sizes a tile then
holds about one expert's rows. Two kernels, each one program per
(row tile, column tile), a 1-D grid in grouped order (``gemm_config``):

1. gate / up: ``x [tile rows, H] @ w_gate_up[e]`` into a gate and an up accumulator (float32),
   a ``block_k`` loop over H that Triton pipelines; the epilogue writes ``silu(gate) * up`` in
   the input dtype to the ``[E * C, F]`` intermediate, rows before the tile's end row only.
2. down: ``hidden [tile rows, F] @ w_down[e]`` (float32 accumulate) into the output, which is
   a zero buffer aliased to the result, so rows no tile writes stay zero; or, for callers
   that never read the padding (``zero_padding=False``), a fresh buffer whose padding rows
   are never written, which saves zeroing ``E * C * H`` values per call.

A dead tile (expert -1) returns after reading its table entry: no loads, no matmul. Rows
past the end row inside a live tile are masked on load (read as zero) and on store. The
intermediate is rounded to the input dtype as in the ``"xla"`` impl.

``impl="mosaic"`` runs the same FFN as Hopper kernels (Pallas Mosaic GPU, TMA and ``wgmma``;
``grouped_gemm_mosaic``) over the filled slots gathered into tile-major rows, and returns its
result as ``SlotRows`` over those rows (``grouped_ffn_rows``; ``grouped_ffn`` materializes the
slot layout). ``impl="auto"`` (or None) picks by the call's static rows (``auto_impl``): the
Mosaic kernels from ``MOSAIC_MIN_ROWS`` on a Hopper GPU, the Pallas ones below, and the
Mosaic ones at any rows for weights the Pallas kernels cannot index (``triton_offsets_fit``:
the Triton lowering's 32-bit offsets wrap inside FP8 weights of 2**31 to 2**32 values, such as
DeepSeek-V3's 256 experts on one device).

``impl="xla"`` is the capacity-slot batched einsum over all ``C`` slots (the CPU path and
the measured alternative), with the hidden rows past ``counts`` set to zero so that both impls
mean the same thing. ``grouped_ffn_reference`` is the exact-count definition in float32:
the live rows compacted and run through ``jax.lax.ragged_dot``.

FP8 weights. Both weights may be block-scaled ``float8_e4m3fn`` (``fp8_blocks.BlockQuantized``,
blocks of ``(qk, qn)`` over each expert's contraction and output axes). The Pallas kernels read
them stored contraction-last (``fp8_blocks.expert_axes``: each expert's matrices ``[out, in]``,
as the checkpoint has them), the order in which an FP8 tensor-core dot takes its second
operand; their block_k and block_n divide the block sizes, so a weight tile has one scale.
Two schemes (``fp8_activations``):

* FP8 activations (the default; DeepSeek-V3's inference scheme): each row of x is quantized
  per ``qk`` columns (one float32 scale per row and group, ``fp8_blocks.quantize_blocks`` in
  ``(1, qk)`` blocks). Slot rows (a slot buffer) are quantized inside the gate / up kernel
  when its contraction step is one group (``block_k == qk``): each step quantizes the rows
  it loads, so the padding slots are never quantized. Source rows (``SlotRows``), one per
  token, are quantized before the kernel, once each rather than once per column tile. Each
  step is an FP8 x FP8 dot with float32 sums, scaled by the rows' and the block's scales. The
  gate / up epilogue quantizes the hidden rows the same way, per the down weight's ``qk``
  columns, which is its column tile, so a tile row is one group and its scale is the tile
  row's largest magnitude; the down kernel reads FP8 hidden rows and their scales.
* Weight-only (``fp8_activations=False``): the rows stay in their float dtype; each FP8 tile is
  widened to it (exact: e4m3 values are bf16 values) and the partial product scaled.

Either way the weights are read from memory as FP8, half the bytes of bf16: what decode, which
reads every local expert's weights once a step, is bound by. ``impl="xla"`` runs the same
arithmetic over every slot (dequantized weights; with FP8 activations the rows quantized and
dequantized, float32 math); ``grouped_ffn_reference`` defines both schemes. ``impl="mosaic"``
runs FP8 activations as Hopper kernels (``grouped_gemm_mosaic_fp8``: FP8 ``wgmma``, the
partial sums promoted per weight block) and refuses weight-only FP8; ``"auto"`` takes it
for FP8 activations from ``MOSAIC_FP8_MIN_ROWS_PER_EXPERT`` rows an expert.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.core import arith
from jtbo.kernels import (
    fp8_blocks,
    gemm_config,
    grouped_gemm_mosaic,
    grouped_gemm_mosaic_fp8,
    impls,
    slot_rows,
    tile_table,
)

_F32 = jnp.float32
AUTO = "auto"
"""``impl="auto"`` (or None): the impl by the call's rows (``auto_impl``)."""
MOSAIC_MIN_ROWS = 16384
"""Rows (``max_rows``, else ``E * C``) from which ``"auto"`` takes ``"mosaic"`` on a Hopper
GPU: the smallest size measured where the Mosaic GPU layer beat the Pallas one (2048 tokens x 8
experts; at decode sizes, where both read the weights once, Pallas was ahead: docs/benchmarks/,
"the grouped FFN on Mosaic GPU")."""
MOSAIC_FP8_MIN_ROWS_PER_EXPERT = 32
"""The same threshold for FP8 weights with FP8 activations, per expert (rows from this many
times the experts): the FP8 Pallas kernels slow down as an expert's rows fill their tiles,
where the Mosaic GPU kernels run at the FP8 tensor-core rate, so where the two meet depends on
the rows an expert holds, not on the call's rows. The rows an expert from which the Mosaic GPU
FP8 layer was level or ahead at every expert shape measured (docs/benchmarks/, "FP8 experts:
the Mosaic threshold" and "the FP8 Mosaic threshold per expert")."""


def _tile_at(pid, *, num_tiles: int, num_n: int, group_m: int):
    """(row tile, column tile) of program ``pid``: ``group_m`` row tiles walk the columns."""
    per_group = group_m * num_n
    first = (pid // per_group) * group_m
    size = jnp.minimum(num_tiles - first, group_m)
    within = pid % per_group
    return first + within % size, within // size


def _tile_rows(counts_ref, tile, block_m: int, capacity: int):
    """``(expert or -1, first row, [block_m, 1] mask of the rows before its expert's end)``
    of live tile ``tile``, from ``counts_ref [E2]`` (the experts' rows, zero-padded to a power
    of two): the row ``tile_table.row_tiles`` lists for it. The expert is the number of experts
    whose tiles end at or before ``tile`` (-1 past the live tiles); its rows start at
    ``expert * capacity``."""
    counts = counts_ref[...]
    blocks = (counts + (block_m - 1)) // block_m
    ends = jnp.cumsum(blocks)
    expert = jnp.sum((ends <= tile).astype(jnp.int32))
    is_expert = jnp.arange(counts.shape[0], dtype=jnp.int32) == expert
    first = jnp.sum(jnp.where(is_expert, ends - blocks, 0))
    group_start = expert * capacity
    end = group_start + jnp.sum(jnp.where(is_expert, counts, 0))
    start = group_start + (tile - first) * block_m
    live = (start + jnp.arange(block_m, dtype=jnp.int32) < end)[:, None]
    return jnp.where(tile < jnp.sum(blocks), expert, -1), start, live


@dataclasses.dataclass(frozen=True)
class _Fp8:
    """How a kernel reads FP8 weights: ``quant_block = (qk, qn)`` blocks of a weight stored
    contraction-last (``[E, N, K]``); ``activations``: whether its rows come as FP8 values with
    a float32 scale per row and ``qk`` columns (else float rows, the weight tile widened)."""

    quant_block: tuple[int, int]
    activations: bool


def _gate_up_kernel(
    counts_ref, *refs, num_tiles, num_n, group_m, block_m, block_n, block_k, ffn, gathered, fp8,
    quantize_rows, capacity,
):  # fmt: skip
    # counts_ref: [E2] int32 rows per expert (zero-padded to a power of two). Then, in order:
    # source_ref [R] int32 (gathered only): the row of x_ref each slot holds (-1 empty);
    # x_ref [R, H] slot rows, or [N, H] source rows when gathered (FP8 with FP8 activations
    # quantized before the kernel; float rows that quantize_rows quantizes per step here);
    # xs_ref [R or N, H / qk] float32 row scales (FP8 activations quantized before only);
    # w_ref [E, H, 2 * F] (gate columns, then up columns), or FP8 [E, 2 * F, H] (gate rows,
    # then up rows); s_ref [E, 2 * ceil(F / qn), H / qk] float32 block scales (FP8 only);
    # h_ref [R, F] (FP8 with FP8 activations); hs_ref [R, F / block_n] float32 (FP8
    # activations only: one scale per row and column tile).
    refs = list(refs)
    source_ref = refs.pop(0) if gathered else None
    x_ref = refs.pop(0)
    xs_ref = refs.pop(0) if fp8 is not None and fp8.activations and not quantize_rows else None
    weights = _WeightTiles(refs.pop(0), refs.pop(0) if fp8 is not None else None, fp8)
    h_ref, hs_ref = refs[0], refs[1] if len(refs) > 1 else None
    tile, col = _tile_at(pl.program_id(0), num_tiles=num_tiles, num_n=num_n, group_m=group_m)
    expert, start, live = _tile_rows(counts_ref, tile, block_m, capacity)

    @pl.when(expert >= 0)
    def _compute():
        qk = fp8.quant_block[0] if fp8 is not None else block_k
        load_rows = _row_loader(source_ref, x_ref, xs_ref, start, live, (block_m, block_k), qk)
        if quantize_rows:  # a contraction step is one quantization group of each row
            load_rows = _quantized(load_rows)
        n0 = pl.multiple_of(col * block_n, block_n)
        up_scale_row = 0 if fp8 is None else arith.ceil_div(ffn, fp8.quant_block[1])

        def step(i, acc):
            k0 = pl.multiple_of(i * block_k, block_k)
            x, x_scale = load_rows(k0)
            gate = weights.dot(x, x_scale, expert, k0, n0, (block_k, block_n))
            up = weights.dot(x, x_scale, expert, k0, n0, (block_k, block_n), (ffn, up_scale_row))
            return acc[0] + gate, acc[1] + up

        zeros = jnp.zeros((block_m, block_n), _F32)
        gate, up = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, (zeros, zeros))
        hidden = gate * jax.nn.sigmoid(gate) * up
        # Every live slot's row is written (an empty slot's as zero): the down kernel reads it.
        h_mask = jnp.broadcast_to(live, (block_m, block_n))
        rows = pl.ds(start, block_m)
        if hs_ref is not None:  # one quantization group per row of the tile
            hidden, scale = _quantize_rows(hidden)
            plgpu.store(hs_ref.at[rows, pl.ds(col, 1)], scale, mask=live)
        plgpu.store(h_ref.at[rows, pl.ds(n0, block_n)], hidden.astype(h_ref.dtype), mask=h_mask)


def _quantized(load_rows):
    """``load_rows`` (float rows, no scales) with each loaded row quantized on its own."""

    def load(k0):
        x, _ = load_rows(k0)
        return _quantize_rows(x.astype(_F32))

    return load


def _quantize_rows(values):
    """``(values / scale as FP8, scale [rows, 1])``, a scale per row: its largest magnitude
    over ``fp8_blocks.FP8_MAX`` (1 for an all-zero row), as ``fp8_blocks.quantize_blocks``."""
    amax = jnp.max(jnp.abs(values), axis=1, keepdims=True)
    scale = jnp.where(amax > 0, amax * fp8_blocks.INV_FP8_MAX, 1.0)
    return (values / scale).astype(fp8_blocks.FP8_DTYPE), scale


class _WeightTiles:
    """A kernel's expert weight: ``w_ref [E, K, N]`` in the rows' dtype, or FP8 values stored
    contraction-last, ``w_ref [E, N, K]``, with ``s_ref [E, ceil(N / qn), ceil(K / qk)]``
    float32 scales of ``fp8.quant_block = (qk, qn)`` blocks (``jtbo.kernels.fp8_blocks``). A
    tile lies inside one block (``_launch`` picks block_k / block_n dividing the block), so
    its partial product takes one scale. FP8 rows (``fp8.activations``) meet the FP8 tile in
    an FP8 tensor-core dot, the product scaled by the rows' and the block's scales; float rows
    meet the tile widened to their dtype (exact: e4m3 values are bf16 values). Either way the
    weights stay FP8 in memory and are read once."""

    def __init__(self, w_ref, s_ref, fp8):
        self.w_ref, self.s_ref, self.fp8 = w_ref, s_ref, fp8

    def dot(self, x, x_scale, expert, k0, n0, shape, offsets=(0, 0)):
        """``x [block_m, block_k] @`` the weight tile at contraction ``k0``, columns
        ``offsets[0] + n0`` (float32); ``x_scale [block_m, 1]`` the rows' scales (FP8 rows)
        or None; ``offsets[1]`` is the tile's first scale row past ``n0``'s."""
        block_k, block_n = shape
        columns = pl.ds(offsets[0] + n0, block_n)
        if self.fp8 is None:
            w = self.w_ref[expert, pl.ds(k0, block_k), columns]
            return jnp.dot(x, w, preferred_element_type=_F32)
        w = self.w_ref[expert, columns, pl.ds(k0, block_k)]  # [block_n, block_k] FP8
        w = w if x_scale is not None else w.astype(x.dtype)
        part = jnp.dot(x, w.T, preferred_element_type=_F32)
        qk, qn = self.fp8.quant_block
        scale = self.s_ref[expert, offsets[1] + n0 // qn, k0 // qk]
        return part * (scale if x_scale is None else x_scale * scale)


def _row_loader(source_ref, x_ref, xs_ref, start, live, shape: tuple[int, int], qk: int):
    """``k0 -> (the tile's [block_m, block_k] rows, their [block_m, 1] scales or None)``.

    Slot rows are ``block_m`` consecutive rows of x from ``start``; gathered rows are the
    rows the tile's slots name, each row's ``block_k`` columns still contiguous. The gathered
    view indexes both axes with arrays (rows ``[block_m, 1]``, columns ``[1, block_k]``): the
    Pallas interpreter cannot mix an array index with a slice. Rows past the tile's end and
    empty slots (-1) load as zero. FP8 rows (``xs_ref`` not None) come with the scale of
    their ``qk`` columns that hold ``k0``.
    """
    block_m, block_k = shape
    if source_ref is None:
        rows, live_rows = pl.ds(start, block_m), live
        view = lambda k0: x_ref.at[rows, pl.ds(k0, block_k)]  # noqa: E731
        scale_view = lambda k0: xs_ref.at[rows, pl.ds(k0 // qk, 1)]  # noqa: E731
    else:
        source = plgpu.load(source_ref.at[pl.ds(start, block_m)], mask=live[:, 0], other=-1)
        row = jnp.maximum(source, 0)[:, None]
        columns = jnp.arange(block_k, dtype=jnp.int32)[None, :]
        view = lambda k0: x_ref.at[row, k0 + columns]  # noqa: E731
        scale_view = lambda k0: xs_ref.at[row, k0 // qk + jnp.zeros((1, 1), jnp.int32)]  # noqa: E731
        live_rows = live & (source >= 0)[:, None]
    x_mask = jnp.broadcast_to(live_rows, (block_m, block_k))

    def load(k0):
        if xs_ref is None:
            return plgpu.load(view(k0), mask=x_mask, other=0), None
        # FP8 rows: masked rows load undefined values (Triton has no FP8 fill value); a row
        # only ever meets itself (its products, its own scale), and masked rows are not stored.
        x = plgpu.load(view(k0), mask=x_mask)
        return x, plgpu.load(scale_view(k0), mask=live_rows, other=0)

    return load


def _down_kernel(
    counts_ref, h_ref, *refs, num_tiles, num_n, group_m, block_m, block_n, block_k, fp8, capacity,
):  # fmt: skip
    # counts_ref: [E2] int32; h_ref: [R, F] (FP8 with FP8 activations). Then, in
    # order: hs_ref [R, F / qk] float32 row scales (FP8 activations only); w_ref [E, F, H], or
    # FP8 [E, H, F]; s_ref [E, ceil(H / qn), F / qk] float32 block scales (FP8 only); then
    # out_ref [R, H] alone (rows no tile writes are left as they are), or a zero buffer and
    # out_ref, the same buffer (aliased; rows no tile writes stay zero).
    refs = list(refs)
    hs_ref = refs.pop(0) if fp8 is not None and fp8.activations else None
    weights = _WeightTiles(refs.pop(0), refs.pop(0) if fp8 is not None else None, fp8)
    out_ref = refs[-1]
    tile, col = _tile_at(pl.program_id(0), num_tiles=num_tiles, num_n=num_n, group_m=group_m)
    expert, start, live = _tile_rows(counts_ref, tile, block_m, capacity)

    @pl.when(expert >= 0)
    def _compute():
        qk = fp8.quant_block[0] if fp8 is not None else block_k
        load_rows = _row_loader(None, h_ref, hs_ref, start, live, (block_m, block_k), qk)
        n0 = pl.multiple_of(col * block_n, block_n)

        def step(i, acc):
            k0 = pl.multiple_of(i * block_k, block_k)
            h, h_scale = load_rows(k0)
            return acc + weights.dot(h, h_scale, expert, k0, n0, (block_k, block_n))

        acc = jnp.zeros((block_m, block_n), _F32)
        acc = jax.lax.fori_loop(0, h_ref.shape[1] // block_k, step, acc)
        out_mask = jnp.broadcast_to(live, (block_m, block_n))
        out = acc.astype(out_ref.dtype)
        plgpu.store(out_ref.at[pl.ds(start, block_m), pl.ds(n0, block_n)], out, mask=out_mask)


def _launch(
    rows: int, k_dim: int, n_dim: int, cfg: gemm_config.GemmConfig, interpret: bool,
    quant_block: tuple[int, int] | None = None,
):  # fmt: skip
    """(block_m, block_n, block_k) of one kernel; raises when Triton cannot tile the shape.

    With FP8 weights in ``quant_block = (qk, qn)`` blocks, block_k and block_n also divide
    ``qk`` and ``qn``, so that each weight tile lies inside one block (one scale).
    """
    k_tiled, n_tiled = k_dim, n_dim
    if quant_block is not None:
        k_tiled, n_tiled = math.gcd(k_dim, quant_block[0]), math.gcd(n_dim, quant_block[1])
    blocks = (cfg.rows_block(rows), gemm_config.fit(cfg.block_n, n_tiled))
    blocks += (gemm_config.fit(cfg.block_k, k_tiled),)
    if not interpret and min(blocks) < gemm_config.MIN_DOT_BLOCK:
        within = "" if quant_block is None else f" inside FP8 blocks {quant_block}"
        raise impls.KernelUnavailableError(
            f"impl='pallas' tiles by powers of two >= {gemm_config.MIN_DOT_BLOCK}: contraction "
            f"{k_dim} and columns {n_dim}{within} give blocks {blocks[1:]}; use impl='xla'"
        )
    return blocks


def tile_row_count(capacity: int, max_rows: int | None, num_experts: int, balanced: bool) -> int:
    """The rows per expert the row tile is sized for (``GemmConfig.rows_block``): with
    ``balanced`` and a bound on the call's rows, the balanced load ``ceil(max_rows / E)`` (at
    most ``capacity``), else ``capacity``.

    The capacity is a bound (the EP capacity factor sets it at several times the balanced
    load); sizing the tile by it leaves most of each tile's rows empty at decode sizes, where
    the kernels read every expert's weights once and a smaller tile costs no extra bytes.
    An expert holding more rows than the tile takes more tiles (``tile_table.max_tiles``
    bounds their number by ``max_rows``).
    """
    if max_rows is None or not balanced:
        return capacity
    return max(1, min(capacity, arith.ceil_div(max_rows, num_experts)))


def _gate_up_launch(rows, hidden, ffn, cfg, interpret, fp8, down_fp8):
    """``_launch`` of the gate / up kernel. With FP8 activations its column tile is the down
    weight's contraction block: the hidden rows are quantized per tile row, one group each.

    Raises:
      KernelUnavailableError: as ``_launch``; FP8 activations whose groups the column tiles
        cannot cover.
    """
    if fp8 is None or not fp8.activations:
        return _launch(rows, hidden, ffn, cfg, interpret, fp8 and fp8.quant_block)
    group = min(down_fp8.quant_block[0], ffn)  # one partial block when F is narrower
    cfg = dataclasses.replace(cfg, block_n=arith.power_of_two_at_least(group, 1))
    blocks = _launch(rows, hidden, ffn, cfg, interpret, fp8.quant_block)
    if blocks[1] != group or ffn % group:
        raise impls.KernelUnavailableError(
            f"FP8 activations quantize the hidden rows per {group} columns (the down weight's "
            f"contraction block), one gate / up column tile each: F {ffn} and blocks "
            f"{fp8.quant_block} give tiles of {blocks[1]}; use fp8_activations=False or "
            "impl='xla'"
        )
    return blocks


def _weight_operands(w, matrix_shape: tuple[int, int, int]) -> tuple[list, tuple | None]:
    """``([values [E, N, K]] + [scales [E, Nb, Kb]], (qk, qn))`` of a ``BlockQuantized``
    weight stored contraction-last, or ``([w as matrix_shape [E, K, N]], None)``;
    ``w_gate_up``'s gate and up rows (and blocks) lie one after the other.

    Raises:
      ValueError: FP8 weights in another stored order.
      KernelUnavailableError: a weight the kernels' offsets cannot index
        (``triton_offsets_fit``).
    """
    values = w.values if isinstance(w, fp8_blocks.BlockQuantized) else w
    if not triton_offsets_fit(values.size, jnp.dtype(values.dtype).itemsize):
        raise impls.KernelUnavailableError(
            f"impl='pallas' cannot index a {values.dtype} expert weight of {values.size} values "
            "(the Triton lowering offsets an operand of at most 2**32 bytes by signed 32-bit "
            "element counts, which wrap past 2**31): use impl='mosaic', or fewer experts per "
            "device (expert parallelism)"
        )
    if not isinstance(w, fp8_blocks.BlockQuantized):
        return [w.reshape(matrix_shape)], None
    _, k, n = matrix_shape
    values, scales = fp8_blocks.expert_matrices(w, n, k, "pallas")
    return [values, scales], (w.block_shape[1], w.block_shape[-1])


def triton_offsets_fit(size: int, itemsize: int) -> bool:
    """Whether the Pallas kernels (Triton lowering) can index an operand of ``size`` elements
    of ``itemsize`` bytes.

    The lowering offsets pointers by 64-bit element counts only for operands over 2**32
    bytes, and by signed 32-bit ones otherwise, which wrap past 2**31 elements: a 1-byte
    (FP8) operand of 2**31 to 2**32 values is read out of bounds (an illegal address).

    Args:
      size: the operand's elements.
      itemsize: bytes per element.

    Returns:
      False where the offsets wrap.
    """
    return size <= 2**31 or size * itemsize > 2**32


def _rows_quantized_in_kernel(source, block_k: int, qk: int) -> bool:
    """Whether the gate / up kernel quantizes its FP8 rows as it loads them (else they are
    quantized before it). Slot rows (``source`` None), padding included, are quantized in the
    kernel when a contraction step is one group: only the live rows are then quantized. Source
    rows are few: quantized before, once each (inside, each column tile would quantize them
    again, which cost the gate / up kernel more than the three small passes before it)."""
    return source is None and block_k == qk


def _gate_up_call(
    x_rows, source, w_gate_up, counts, *, rows, tile_rows, max_rows, cfg, interpret,
    fp8, down_fp8,
):  # fmt: skip
    """Kernel 1: the ``[E * C, F]`` hidden rows of every live tile (and their row scales with
    FP8 activations), from slot rows ``x_rows [E * C, H]`` (``source`` None) or from source
    rows ``x_rows [N, H]`` through ``source [E * C]`` (the row each slot holds, -1 empty)."""
    num_experts, hidden, _, ffn = w_gate_up.shape
    weights, _ = _weight_operands(w_gate_up, (num_experts, hidden, 2 * ffn))
    block_m, block_n, block_k = _gate_up_launch(
        tile_rows, hidden, ffn, cfg, interpret, fp8, down_fp8
    )
    num_tiles = tile_table.max_tiles(num_experts, rows, block_m, max_rows)
    num_n = ffn // block_n
    fp8_rows = fp8 is not None and fp8.activations
    quantize_rows = fp8_rows and _rows_quantized_in_kernel(source, block_k, fp8.quant_block[0])
    kernel = functools.partial(
        _gate_up_kernel, num_tiles=num_tiles, num_n=num_n, group_m=cfg.group_m,
        block_m=block_m, block_n=block_n, block_k=block_k, ffn=ffn, gathered=source is not None,
        fp8=fp8, quantize_rows=quantize_rows, capacity=rows,
    )  # fmt: skip
    operands = [_padded_counts(counts)]
    operands += [] if source is None else [source]
    flat_rows = num_experts * rows
    if fp8_rows:
        if quantize_rows:
            operands += [x_rows, *weights]
        else:
            quantized = fp8_blocks.quantize_rows(x_rows, fp8.quant_block[0])
            operands += [quantized.values, quantized.scales, *weights]
        out_shape = (
            jax.ShapeDtypeStruct((flat_rows, ffn), fp8_blocks.FP8_DTYPE),
            jax.ShapeDtypeStruct((flat_rows, num_n), _F32),
        )
    else:
        operands += [x_rows, *weights]
        out_shape = jax.ShapeDtypeStruct((flat_rows, ffn), x_rows.dtype)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tiles * num_n,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(*operands)


def _down_call(
    hidden_rows, w_down, counts, *, rows, tile_rows, max_rows, cfg, interpret,
    zero_padding, fp8, out_dtype,
):  # fmt: skip
    """Kernel 2 over flat hidden rows (``[R, F]``, or with FP8 activations ``(values, row
    scales)``): ``[R, H]``, outside the live rows zero (``zero_padding``, a zero buffer aliased
    to the output) or never written."""
    num_experts, ffn, hidden = w_down.shape
    weights, quant_block = _weight_operands(w_down, (num_experts, ffn, hidden))
    block_m, block_n, block_k = _launch(tile_rows, ffn, hidden, cfg, interpret, quant_block)
    num_tiles = tile_table.max_tiles(num_experts, rows, block_m, max_rows)
    num_n = hidden // block_n
    kernel = functools.partial(
        _down_kernel, num_tiles=num_tiles, num_n=num_n, group_m=cfg.group_m,
        block_m=block_m, block_n=block_n, block_k=block_k, fp8=fp8, capacity=rows,
    )  # fmt: skip
    h_operands = list(hidden_rows) if isinstance(hidden_rows, tuple) else [hidden_rows]
    out_shape = jax.ShapeDtypeStruct((h_operands[0].shape[0], hidden), out_dtype)
    operands = [_padded_counts(counts), *h_operands]
    operands += weights
    aliases = {len(operands): 0} if zero_padding else {}  # the zero buffer is the output
    operands += [jnp.zeros(out_shape.shape, out_shape.dtype)] if zero_padding else []
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tiles * num_n,),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(*operands)


def _padded_counts(counts: jax.Array) -> jax.Array:
    """``counts [E]`` zero-padded to a power of two (``_tile_rows`` reads them as one vector,
    which the Triton lowering needs a power of two long)."""
    num_experts = counts.shape[0]
    return jnp.pad(counts, (0, arith.power_of_two_at_least(num_experts, 1) - num_experts))


def _fp8_modes(w_gate_up, w_down, fp8_activations: bool) -> tuple[_Fp8 | None, _Fp8 | None]:
    """The gate / up and the down kernels' ``_Fp8`` (None for float weights)."""
    if not isinstance(w_gate_up, fp8_blocks.BlockQuantized):
        return None, None
    return tuple(
        _Fp8((w.block_shape[1], w.block_shape[-1]), fp8_activations) for w in (w_gate_up, w_down)
    )


def grouped_ffn_pallas(
    x_slots, counts, w_gate_up, w_down, *, max_rows, cfg, interpret, zero_padding=True,
    fp8_activations=True,
):  # fmt: skip
    """Pallas impl over the capacity-slot layout (``counts`` already clipped to ``[0, C]``);
    ``x_slots`` a slot buffer or ``SlotRows`` (loaded through its row index)."""
    num_experts, capacity, hidden = x_slots.shape
    tile_rows = tile_row_count(capacity, max_rows, num_experts, cfg.balanced_row_tiles)
    common = dict(rows=capacity, tile_rows=tile_rows, max_rows=max_rows, interpret=interpret)
    if isinstance(x_slots, slot_rows.SlotRows):
        x_rows, source = x_slots.rows, x_slots.slot_row.reshape(-1).astype(jnp.int32)
    else:
        x_rows, source = x_slots.reshape(num_experts * capacity, hidden), None
    gate_up_fp8, down_fp8 = _fp8_modes(w_gate_up, w_down, fp8_activations)
    hidden_rows = _gate_up_call(
        x_rows, source, w_gate_up, counts, cfg=cfg.gate_up, fp8=gate_up_fp8,
        down_fp8=down_fp8, **common,
    )  # fmt: skip
    out = _down_call(
        hidden_rows, w_down, counts, cfg=cfg.down, zero_padding=zero_padding,
        fp8=down_fp8, out_dtype=x_rows.dtype, **common,
    )  # fmt: skip
    return out.reshape((num_experts, capacity, w_down.shape[2]))


def grouped_ffn_xla(x_slots, counts, w_gate_up, w_down):
    """XLA impl: batched einsums over all ``C`` slots, hidden rows past ``counts`` zeroed
    (``x_slots`` a slot buffer; ``grouped_ffn`` materializes ``SlotRows``)."""
    gate_up = jnp.einsum("ech,ehsf->ecsf", x_slots, w_gate_up, preferred_element_type=_F32)
    hidden = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
    live = jnp.arange(x_slots.shape[1], dtype=jnp.int32)[None, :] < counts[:, None]
    hidden = jnp.where(live[..., None], hidden, 0.0).astype(x_slots.dtype)
    out = jnp.einsum("ecf,efh->ech", hidden, w_down, preferred_element_type=_F32)
    return out.astype(x_slots.dtype)


def _xla_any_weights(x_slots, counts, w_gate_up, w_down, fp8_activations: bool) -> jax.Array:
    """``grouped_ffn_xla`` over float weights; over FP8 ones, dequantized to the rows' dtype
    (weight-only), or with quantized rows the reference's arithmetic over all slots."""
    if not isinstance(w_gate_up, fp8_blocks.BlockQuantized):
        return grouped_ffn_xla(x_slots, counts, w_gate_up, w_down)
    if not fp8_activations:
        w_gate_up, w_down = (_float_weight(w, x_slots.dtype) for w in (w_gate_up, w_down))
        return grouped_ffn_xla(x_slots, counts, w_gate_up, w_down)
    out = _fp8_activations_ffn(x_slots.astype(_F32), w_gate_up, w_down, precision=None)
    live = jnp.arange(x_slots.shape[1], dtype=jnp.int32)[None, :] < counts[:, None]
    return jnp.where(live[..., None], out, 0.0).astype(x_slots.dtype)


def _fp8_activations_ffn(x, w_gate_up, w_down, *, precision) -> jax.Array:
    """The FFN of FP8 weights with FP8 activations over ``x [E, C, H]`` float32, every slot:
    rows and hidden rows quantized per their weight's contraction block, float32 math."""
    gate_up_block, down_block = w_gate_up.block_shape[1], w_down.block_shape[1]
    x = fp8_blocks.fake_quantize_rows(x, gate_up_block)
    w_gu, w_d = (_float_weight(w, _F32) for w in (w_gate_up, w_down))
    gate_up = jnp.einsum("ech,ehsf->ecsf", x, w_gu, precision=precision)
    hidden = fp8_blocks.fake_quantize_rows(
        jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], down_block
    )
    return jnp.einsum("ecf,efh->ech", hidden, w_d, precision=precision)


def _check_inputs(x_slots, counts, w_gate_up, w_down) -> None:
    if isinstance(x_slots, slot_rows.SlotRows):
        if x_slots.rows.ndim != 2 or x_slots.slot_row.ndim != 2:
            raise ValueError(
                f"SlotRows must hold rows [N, H] and slot_row [E, C], got shapes "
                f"{x_slots.rows.shape} and {x_slots.slot_row.shape}"
            )
        if not jnp.issubdtype(x_slots.slot_row.dtype, jnp.integer):
            raise ValueError(f"slot_row must be integers, got {x_slots.slot_row.dtype}")
    elif x_slots.ndim != 3:
        raise ValueError(f"x_slots must be [E, C, H], got shape {x_slots.shape}")
    num_experts, _, hidden = x_slots.shape
    if len(w_gate_up.shape) != 4 or tuple(w_gate_up.shape[:3]) != (num_experts, hidden, 2):
        raise ValueError(
            f"w_gate_up shape {w_gate_up.shape} must be [E={num_experts}, H={hidden}, 2, F]"
        )
    want_down = (num_experts, w_gate_up.shape[3], hidden)
    if tuple(w_down.shape) != want_down:
        raise ValueError(f"w_down shape {w_down.shape} must be [E, F, H] = {want_down}")
    if counts.shape != (num_experts,) or not jnp.issubdtype(counts.dtype, jnp.integer):
        raise ValueError(
            f"counts must be [{num_experts}] integers, got {counts.shape} {counts.dtype}"
        )
    _check_dtypes(x_slots, w_gate_up, w_down)


def _check_dtypes(x_slots, w_gate_up, w_down) -> None:
    """One dtype for the rows and both weights, or FP8 weights (both ``BlockQuantized``, in
    blocks over their contraction and output axes only) beside float rows."""
    quantized = [isinstance(w, fp8_blocks.BlockQuantized) for w in (w_gate_up, w_down)]
    if not any(quantized):
        dtypes = {x_slots.dtype, w_gate_up.dtype, w_down.dtype}
        if len(dtypes) != 1:
            raise ValueError(f"x_slots, w_gate_up and w_down must share a dtype, got {dtypes}")
        return
    if not all(quantized):
        raise ValueError(
            "w_gate_up and w_down must both be FP8 (fp8_blocks.BlockQuantized) or both arrays, "
            f"got {type(w_gate_up).__name__} and {type(w_down).__name__}"
        )
    if not jnp.issubdtype(x_slots.dtype, jnp.floating) or jnp.dtype(x_slots.dtype).itemsize < 2:
        raise ValueError(f"x_slots of FP8 weights must be float16 or wider, got {x_slots.dtype}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        w.check()
        wanted = fp8_blocks.expert_block_shape(w.ndim, (w.block_shape[1], w.block_shape[-1]))
        if w.block_shape != wanted:
            raise ValueError(
                f"{name} blocks {w.block_shape} must span its contraction and output axes only "
                f"(e.g. {wanted})"
            )


def _quant_block(w_gate_up) -> tuple[int, int] | None:
    """``(qk, qn)`` of FP8 weights, None for float ones."""
    if isinstance(w_gate_up, fp8_blocks.BlockQuantized):
        return w_gate_up.block_shape[1], w_gate_up.block_shape[-1]
    return None


def _float_weight(w, dtype):
    """``w``, or an FP8 weight dequantized to ``dtype``."""
    if isinstance(w, fp8_blocks.BlockQuantized):
        return fp8_blocks.dequantize_blocks(w, dtype)
    return w


Weight = jax.Array | fp8_blocks.BlockQuantized
"""An expert weight: an array in the rows' dtype, or block-scaled FP8 (``fp8_blocks``)."""


def grouped_ffn(
    x_slots: jax.Array | slot_rows.SlotRows,
    counts: jax.Array,
    w_gate_up: Weight,
    w_down: Weight,
    *,
    impl: str | None = None,
    config: gemm_config.GroupedFfnConfig | gemm_config.MosaicFfnConfig | None = None,
    max_rows: int | None = None,
    zero_padding: bool = True,
    fp8_activations: bool = True,
) -> jax.Array:
    """SwiGLU of every expert over its first ``counts[e]`` slots.

    Args:
      x_slots: ``[E, C, H]`` rows per expert slot; expert ``e``'s rows are its first
        ``counts[e]`` slots. Or ``SlotRows``, the same slots as source rows and a row index
        per slot: ``impl="pallas"`` loads the rows through the index (no slot buffer is
        written), ``impl="xla"`` materializes the slot buffer first.
      counts: ``[E]`` integer rows per expert (may be traced); clipped to ``[0, C]``.
      w_gate_up: ``[E, H, 2, F]`` (gate at index 0, up at 1), in ``x_slots``' dtype; or FP8,
        a ``fp8_blocks.BlockQuantized`` in ``(1, qk, 1, qn)`` blocks (``impl="pallas"``: stored
        contraction-last, ``fp8_blocks.expert_axes``).
      w_down: ``[E, F, H]``, an array with ``w_gate_up``, FP8 in ``(1, qk, qn)`` blocks with it.
      impl: ``"xla"`` (batched einsum over all slots; FP8 weights dequantized first),
        ``"pallas"`` (the Triton-lowered kernels; FP8 weights read as FP8 and scaled per
        block inside the kernel), ``"mosaic"`` (the Mosaic GPU kernels, Hopper;
        ``grouped_gemm_mosaic``, FP8: ``grouped_gemm_mosaic_fp8``), or ``"auto"`` / None: the
        fastest measured for the call's rows and weights (``auto_impl``).
      config: the kernels' launch shapes: a ``GroupedFfnConfig`` for ``"pallas"`` (None:
        ``gemm_config.GROUPED_FFN``, ``GROUPED_FFN_FP8`` for FP8 weights), a
        ``MosaicFfnConfig`` for ``"mosaic"`` (None: ``gemm_config.MOSAIC_FFN``,
        ``mosaic_ffn_fp8(H, F, rows / E)`` for FP8 weights, ``rows`` being ``max_rows``).
      max_rows: static bound on ``sum(min(counts, C))`` that the caller guarantees (e.g. the
        rows an exchange can deliver); the kernel's grid then covers only that many rows'
        tiles. A larger sum leaves the rows of tiles past the bound as padding. None: no
        bound (``E * C``).
      zero_padding: whether slots at or past ``counts[e]`` come out zero. False is for a
        caller that never reads them (the EP combine reads only filled slots): the Pallas
        kernel then leaves them unwritten (undefined values) and skips zeroing an
        ``[E * C, H]`` buffer per call. The XLA and Mosaic impls return zeros either way.
      fp8_activations: FP8 weights: whether the rows (each row's ``qk`` columns) and hidden
        rows are quantized too and multiplied in FP8 (the module docstring; defined by
        ``grouped_ffn_reference``); False: weight-only FP8. Ignored for float weights.

    Returns:
      ``[E, C, H]`` in ``x_slots.dtype``, zero in slots at or past ``counts[e]`` (undefined
      there with ``zero_padding=False`` and the Pallas impl; partial sums when F is a shard of
      the experts' hidden width).

    Raises:
      ValueError: shapes or dtypes that do not fit together, an unknown impl, a bad max_rows,
        weight-only FP8 (``fp8_activations=False``) with ``impl="mosaic"``.
      KernelUnavailableError: the impl cannot run here or cannot tile these shapes.
    """
    out = grouped_ffn_rows(
        x_slots, counts, w_gate_up, w_down, impl=impl, config=config, max_rows=max_rows,
        zero_padding=zero_padding, fp8_activations=fp8_activations,
    )  # fmt: skip
    return out if not isinstance(out, slot_rows.SlotRows) else out.materialize()


def grouped_ffn_rows(
    x_slots: jax.Array | slot_rows.SlotRows,
    counts: jax.Array,
    w_gate_up: Weight,
    w_down: Weight,
    *,
    impl: str | None = None,
    config: gemm_config.GroupedFfnConfig | gemm_config.MosaicFfnConfig | None = None,
    max_rows: int | None = None,
    zero_padding: bool = True,
    fp8_activations: bool = True,
) -> jax.Array | slot_rows.SlotRows:
    """``grouped_ffn`` without materializing the slot layout where an impl has its own.

    The ``"mosaic"`` impl computes in tile-major rows (``grouped_gemm_mosaic``) and returns
    ``SlotRows`` over them: the ``[E, C, H]`` result as rows and a row per slot (-1 for the
    slots past ``counts[e]``, which stand for zeros), which a caller that reads a few slots
    per token gathers from directly. The other impls return the ``[E, C, H]`` array.

    Args, Raises: as ``grouped_ffn``; ``config`` a ``MosaicFfnConfig`` for ``"mosaic"``.

    Returns:
      ``[E, C, H]`` or ``SlotRows`` standing for it (``SlotRows.materialize`` gives the array,
      zero past the counts whatever ``zero_padding``).
    """
    _check_inputs(x_slots, counts, w_gate_up, w_down)
    if max_rows is not None and max_rows < 0:
        raise ValueError(f"max_rows must be >= 0 or None, got {max_rows}")
    num_experts, capacity, hidden = x_slots.shape
    rows = num_experts * capacity if max_rows is None else max_rows
    shape = (rows, hidden, w_gate_up.shape[3], num_experts)
    quant_block = _quant_block(w_gate_up)
    impl = _resolve(impl, config, shape, x_slots.dtype, quant_block, fp8_activations)
    counts = jnp.clip(counts.astype(jnp.int32), 0, capacity)
    if impl == "xla" or math.prod(x_slots.shape) == 0:
        return _xla_any_weights(_materialized(x_slots), counts, w_gate_up, w_down, fp8_activations)
    interpret = impls.backend() == "cpu"
    # Compiled kernels go through a nested jit: a program that calls them with equal shapes
    # and options many times (a model's layers, both micro-batches) lowers them once and calls
    # that lowering (XLA inlines the calls), where each direct call lowers its kernels again.
    # The interpreters are called directly: the Mosaic GPU interpreter's callbacks deadlocked
    # inside the nested jit (one live tile over two clusters).
    kernel_ffn = _kernel_ffn if interpret else _kernel_ffn_jit
    return kernel_ffn(
        x_slots, counts, w_gate_up, w_down, impl=impl, max_rows=max_rows,
        cfg=config or _default_config(impl, w_gate_up, rows), interpret=interpret,
        zero_padding=zero_padding, fp8_activations=fp8_activations,
    )  # fmt: skip


def _kernel_ffn(
    x_slots, counts, w_gate_up, w_down, *, impl, cfg, max_rows, interpret, zero_padding,
    fp8_activations,
):  # fmt: skip
    """The kernel impls of ``grouped_ffn_rows`` (resolved ``impl`` and launch shapes ``cfg``)."""
    if impl == impls.MOSAIC and isinstance(w_gate_up, fp8_blocks.BlockQuantized):
        return grouped_gemm_mosaic_fp8.grouped_ffn_mosaic_fp8(
            x_slots, counts, w_gate_up, w_down, max_rows=max_rows, cfg=cfg, interpret=interpret
        )
    if impl == impls.MOSAIC:
        return grouped_gemm_mosaic.grouped_ffn_mosaic(
            x_slots, counts, w_gate_up, w_down, max_rows=max_rows, cfg=cfg, interpret=interpret
        )
    return grouped_ffn_pallas(
        x_slots, counts, w_gate_up, w_down, max_rows=max_rows, cfg=cfg, interpret=interpret,
        zero_padding=zero_padding, fp8_activations=fp8_activations,
    )  # fmt: skip


_kernel_ffn_jit = jax.jit(
    _kernel_ffn,
    static_argnames=("impl", "cfg", "max_rows", "interpret", "zero_padding", "fp8_activations"),
)


def _default_config(impl: str, w_gate_up, rows: int):
    """The default launch shapes of kernel ``impl`` for float or FP8 weights and a call of at
    most ``rows`` rows."""
    fp8 = isinstance(w_gate_up, fp8_blocks.BlockQuantized)
    if impl == impls.MOSAIC:
        num_experts, hidden, _, ffn = w_gate_up.shape
        return gemm_config.default_mosaic_ffn(hidden, ffn, fp8, rows / num_experts)
    return gemm_config.GROUPED_FFN_FP8 if fp8 else gemm_config.GROUPED_FFN


def _resolve(impl, config, shape: tuple[int, int, int, int], dtype, quant_block, fp8_activations):
    """The impl that serves a call of ``shape = (rows, H, F, E)``; raises for one that cannot.

    Raises:
      ValueError: a ``config`` with ``"auto"``, or of another impl; weight-only FP8
        (``fp8_activations=False``) with ``"mosaic"``.
      KernelUnavailableError: as ``impls.resolve``; ``"triton"``.
    """
    if impl in (None, AUTO):
        if config is not None:
            raise ValueError("launch shapes are an impl's: name the impl with config=")
        impl = auto_impl(
            *shape[:3], dtype, quant_block=quant_block, fp8_activations=fp8_activations,
            num_experts=shape[3],
        )  # fmt: skip
    impl = impls.resolve(impl, op="grouped_ffn")
    if impl == "triton":
        raise impls.KernelUnavailableError("grouped_ffn has no impl='triton'; use 'pallas'")
    if impl == impls.MOSAIC and quant_block is not None and not fp8_activations:
        raise ValueError(
            "impl='mosaic' multiplies FP8 weights by FP8 rows only (fp8_activations=True); "
            "weight-only FP8 runs on impl='pallas' or 'xla'"
        )
    _check_config(impl, config)
    return impl


def auto_impl(
    rows: int, hidden: int, ffn: int, dtype=jnp.bfloat16, *, quant_block=None,
    fp8_activations: bool = True, num_experts: int | None = None,
) -> str:  # fmt: skip
    """The impl ``"auto"`` takes for ``rows`` rows of ``dtype`` through an FFN ``hidden`` wide
    and ``ffn`` deep, its weights float (``quant_block`` None) or FP8 in ``quant_block =
    (qk, qn)`` blocks, with FP8 activations or weight-only (``fp8_activations``).

    ``"mosaic"`` where it runs and tiles the shapes and dtype, from ``MOSAIC_MIN_ROWS`` rows
    (float weights) or ``MOSAIC_FP8_MIN_ROWS_PER_EXPERT`` times ``num_experts`` (FP8 weights
    with FP8 activations); else the backend's fastest (``impls.FASTEST``) if it tiles them
    (FP8: inside the blocks), else ``"xla"``. Where the Pallas kernels cannot index
    ``num_experts`` experts' weights (``triton_offsets_fit``: FP8 weights of 2**31 to 2**32
    values), ``"mosaic"`` at any rows if it serves them, else ``"xla"``.

    Raises:
      ValueError: FP8 weights with FP8 activations and no ``num_experts``, where the Mosaic
        kernels run.
    """
    platform = impls.backend()
    runs_mosaic = platform == "gpu" and _mosaic_runs(
        hidden, ffn, dtype, quant_block, fp8_activations
    )
    if runs_mosaic and rows >= _mosaic_min_rows(quant_block, num_experts):
        return impls.MOSAIC
    impl = impls.resolve(None, op="grouped_ffn")
    dims = (hidden, ffn)
    if quant_block is not None:  # each weight tile inside one block
        dims = tuple(math.gcd(dim, block) for dim in dims for block in quant_block)
    if impl != "pallas":
        return impl
    if not _pallas_indexes(num_experts, hidden, ffn, dtype, quant_block):
        return impls.MOSAIC if runs_mosaic else "xla"
    return impl if all(map(gemm_config.dot_tiles, dims)) else "xla"


def _mosaic_min_rows(quant_block, num_experts: int | None) -> int:
    """The rows from which ``auto_impl`` takes ``"mosaic"``: ``MOSAIC_MIN_ROWS`` for float
    weights, ``MOSAIC_FP8_MIN_ROWS_PER_EXPERT`` times the experts for FP8 ones."""
    if quant_block is None:
        return MOSAIC_MIN_ROWS
    if num_experts is None:
        raise ValueError(
            "auto_impl needs num_experts for FP8 weights (its threshold is per expert)"
        )
    return MOSAIC_FP8_MIN_ROWS_PER_EXPERT * num_experts


def _pallas_indexes(num_experts, hidden, ffn, dtype, quant_block) -> bool:
    """Whether the Pallas kernels index both of ``num_experts`` experts' weights in range
    (``triton_offsets_fit``: ``w_down``'s values may wrap where ``w_gate_up``'s, twice as many,
    are past 2**32 bytes and indexed in 64 bits); True when the count is not given."""
    if num_experts is None:
        return True
    itemsize = jnp.dtype(dtype if quant_block is None else fp8_blocks.FP8_DTYPE).itemsize
    return triton_offsets_fit(num_experts * hidden * 2 * ffn, itemsize) and triton_offsets_fit(
        num_experts * hidden * ffn, itemsize
    )


def _mosaic_runs(hidden, ffn, dtype, quant_block, fp8_activations) -> bool:
    """Whether the Mosaic GPU kernels serve the shapes and dtypes on a GPU, at any rows."""
    if not grouped_gemm_mosaic.runs_dtype(dtype):
        return False
    if impls.unavailable_reason(impls.MOSAIC, "gpu") is not None:
        return False
    if quant_block is None:
        return grouped_gemm_mosaic.tiles(hidden, ffn, gemm_config.MOSAIC_FFN)
    fits = grouped_gemm_mosaic_fp8.tiles(hidden, ffn, quant_block, gemm_config.MOSAIC_FFN_FP8)
    return fp8_activations and fits


def _check_config(impl: str, config) -> None:
    """Raises ValueError when ``config`` is not the launch-shape type of ``impl``."""
    wanted = {impls.MOSAIC: gemm_config.MosaicFfnConfig, "pallas": gemm_config.GroupedFfnConfig}
    if config is not None and impl in wanted and not isinstance(config, wanted[impl]):
        raise ValueError(
            f"impl={impl!r} takes a {wanted[impl].__name__}, got {type(config).__name__}"
        )


def grouped_ffn_reference(
    x_slots: jax.Array | slot_rows.SlotRows,
    counts: jax.Array,
    w_gate_up: Weight,
    w_down: Weight,
    fp8_activations: bool = True,
) -> jax.Array:
    """Exact-count definition in float32: live rows compacted, ``jax.lax.ragged_dot``; FP8
    weights dequantized to float32 (``fp8_blocks.dequantize_blocks``). With FP8 weights and
    ``fp8_activations``: each row of x quantized per ``w_gate_up``'s contraction block and
    each hidden row per ``w_down``'s (``fp8_blocks.quantize_blocks`` in ``(1, qk)`` blocks),
    dequantized, the same float32 math over every slot (padding slots come out zero).

    Args and Returns: as ``grouped_ffn`` (float32 result; the hidden activation is not
    rounded to the input dtype).
    """
    x_slots = _materialized(x_slots)
    if isinstance(w_gate_up, fp8_blocks.BlockQuantized) and fp8_activations:
        counts = jnp.clip(counts.astype(jnp.int32), 0, x_slots.shape[1])
        out = _fp8_activations_ffn(
            x_slots.astype(_F32), w_gate_up, w_down, precision=jax.lax.Precision.HIGHEST
        )
        live = jnp.arange(x_slots.shape[1])[None, :] < counts[:, None]
        return jnp.where(live[..., None], out, 0.0)
    w_gate_up, w_down = (_float_weight(w, _F32) for w in (w_gate_up, w_down))
    num_experts, capacity, hidden = x_slots.shape
    ffn = w_gate_up.shape[3]
    counts = jnp.clip(counts.astype(jnp.int32), 0, capacity)
    live = (jnp.arange(capacity)[None, :] < counts[:, None]).reshape(-1)
    order = jnp.argsort(~live, stable=True)  # live rows first, in expert order
    rows = x_slots.reshape(-1, hidden).astype(_F32)[order]
    w_gu = w_gate_up.astype(_F32).reshape(num_experts, hidden, 2 * ffn)
    precision = jax.lax.Precision.HIGHEST
    gate_up = jax.lax.ragged_dot(rows, w_gu, counts, precision=precision).reshape(-1, 2, ffn)
    h = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
    out = jax.lax.ragged_dot(h, w_down.astype(_F32), counts, precision=precision)
    out = jnp.where(live[order][:, None], out, 0.0)  # rows past every group stay zero
    flat = jnp.zeros_like(out).at[order].set(out)
    return flat.reshape(num_experts, capacity, -1)


def _materialized(x_slots: jax.Array | slot_rows.SlotRows) -> jax.Array:
    """The ``[E, C, H]`` slot buffer of ``x_slots``."""
    if isinstance(x_slots, slot_rows.SlotRows):
        return x_slots.materialize()
    return x_slots
