"""Paged attention that reads K/V straight from the pool: a Pallas kernel and its wrapper.

Same inputs, masking rules and result as ``native.attend`` (which is this op's ``impl="xla"``
and the reference the kernel is tested against), without the native backend's gathered K/V
copy: each kernel program loads a block of pool slots from the page table and then the K/V
rows of those slots, so K/V bytes cross memory once.

Grid: one program per (query tile, KV head x row block, KV split).

* **Rows.** A program's matrix rows are (query row of the tile, query head of the KV head's
  group) pairs, row ``r`` = query ``r // group``, head ``r % group``: GQA folds the group's
  heads into the rows, so a decode tile (one query) of group 8 has 8 rows and shares each
  K/V load between them. Rows are padded to a power of two of at least 16 (the tensor-core
  minimum) and cut into row blocks of at most ``block_rows`` (extend and verify tiles hold
  ``query_tile x group`` rows).
* **KV loop.** A program walks its split of the visible KV positions in blocks of
  ``block_kv``: slots ``req_to_token[req, pos]`` (positions past the sequence read the padding
  slot), K/V rows ``pool[layer, slot, head]``, scores in float32, and the online-softmax
  recurrence (running max, denominator, weighted values) in float32.
* **Visibility** (per row and KV position, as in ``native``): the position is below the
  tile's ``kv_len``; causal capacities also need ``pos <= q_pos + query``; custom-mask
  capacities (TARGET_VERIFY) read the EAGLE bit instead. A program runs only up to the
  furthest position one of its rows may see, so empty tiles and the early tiles of a causal
  prompt cost no K/V reads.
* **Split-K.** Long contexts with few tiles leave SMs idle, so the context of each tile is
  cut into ``splits`` (static) equal parts of its own visible length, rounded to whole
  blocks. Each split writes its normalised partial output and log-sum-exp; the wrapper merges
  them (``o = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)``, ``M = max_s lse_s``), which
  is exact, and scatters the rows to their tokens.
* **Queries and outputs in place.** Queries are loaded from the flat ``[tokens * q_heads,
  head_dim]`` view (``flat_rows``). A causal launch of one split (decode) also stores its
  rows straight into the flat output and zeros its tile's share of the padded tokens' rows,
  so XLA neither gathers queries nor merges, scatters or zero-fills anything. Verify
  launches (custom mask) write partial rows as several splits do: storing them in place
  measured slower there.

Rows that see no key come out as zeros (their log-sum-exp is ``-inf``), as do rows past
``num_tokens``. On the CPU the kernel runs in the Pallas interpreter (tests); on GPUs through
the Pallas Triton lowering.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as _pallas_tpu  # noqa: F401 (see the comment below)
from jax.experimental.pallas import triton as plgpu

from jtbo.attention import flat_rows, native
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.attention import metadata as metadata_lib
from jtbo.kernels import impls, launch_checks

# The Pallas interpreter's first lowering imports this module, which registers a jax config
# option: jax's tracing context changes after that first lowering, so every jitted function
# traced before it is traced again on its next call (the runner's steps guard against that
# with chex.assert_max_traces). Importing it here fixes the context before any trace.
del _pallas_tpu

OP = "paged_attention"
"""This op's key in ``jtbo.kernels.impls.FASTEST``."""
LATENT_OP = "mla_latent_attention"
"""The op's key over an MLA latent pool (``paged_attention(value_width=...)``)."""


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Launch shape of the paged attention kernel.

    Attributes:
      block_kv: KV positions per loop step (a power of two, at least 16).
      block_rows: most matrix rows (query rows x group heads) per program (a power of two,
        at least 16); more rows make more row blocks.
      max_kv_splits: most parts a tile's context is split into.
      min_programs: splits grow (up to ``max_kv_splits``) until the grid has at least this
        many programs, so a small batch still fills the GPU.
      min_split_kv: KV positions a split covers at least (of ``max_context``), so a split's
        fixed cost (its output and the merge) stays small next to its K/V reads.
      num_warps: warps per program (a power of two).
      num_stages: software-pipelining stages Triton may use for the KV loop (the
        ``"triton"`` impl uses fewer where the staged K/V blocks would not fit in shared
        memory: ``triton_stages``).
    """

    block_kv: int = 64
    block_rows: int = 64
    max_kv_splits: int = 16
    min_programs: int = 512
    min_split_kv: int = 256
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        launch_checks.require_powers_of_two(self, ("block_kv", "block_rows", "num_warps"))
        launch_checks.require_at_least(self, ("block_kv", "block_rows"), 16)
        launch_checks.require_at_least(
            self, ("max_kv_splits", "min_programs", "min_split_kv", "num_stages"), 1
        )


DEFAULT_CONFIG = PagedAttentionConfig()
"""The kernel knobs used when none are given (over K/V head pools)."""

# Over an MLA latent pool every query head shares the one latent KV head, so a decode batch
# makes one program per sequence: DEFAULT_CONFIG's min_programs would cut a batch of 128
# sequences' contexts into 4 splits, whose float32 partial rows XLA then merges outside the
# kernel. On an H200 that merge cost more than the extra programs won; one split stores its
# rows in place (docs/benchmarks/, "MLA decode launch").
LATENT_CONFIG = PagedAttentionConfig(min_programs=128, num_stages=3)
"""The kernel knobs used over an MLA latent pool (``value_width``) when none are given."""


@dataclasses.dataclass(frozen=True)
class _Launch:
    """Static launch shape of one call (derived from the capacity, heads and config)."""

    group: int  # query heads per KV head
    rows: int  # real matrix rows of a tile: query_tile * group
    block_rows: int
    row_blocks: int
    splits: int
    key_parts: tuple[tuple[int, int], ...]  # (offset, width) column parts of q and k
    value_width: int | None  # latent: values are the first value_width key columns
    q_heads: int
    tokens: int  # token_capacity
    query_tile: int
    zero_per_tile: int  # padded tokens whose output rows each tile's programs zero
    custom_mask: bool

    @property
    def stores_rows(self) -> bool:
        """Whether the kernel stores the rows in place (else partial rows, merged by XLA).

        One split of a causal capacity stores in place. Verify (custom mask) tiles keep the
        partial rows: storing them in place made the verify case slower on an H200
        (docs/benchmarks/, "The paged kernel's rows in place").
        """
        return self.splits == 1 and not self.custom_mask


def _launch(
    config, capacity: metadata_lib.AttentionCapacity, kv_heads, group, head_dim, value_width
) -> _Launch:
    rows = capacity.query_tile * group
    block_rows = min(config.block_rows, max(16, pl.next_power_of_2(rows)))
    row_blocks = pl.cdiv(rows, block_rows)
    programs = capacity.num_tiles * kv_heads * row_blocks
    splits = min(
        config.max_kv_splits,
        max(1, capacity.max_context // config.min_split_kv),
        max(1, pl.cdiv(config.min_programs, programs)),
    )
    return _Launch(
        group, rows, block_rows, row_blocks, splits, key_parts(head_dim, value_width),
        value_width, kv_heads * group, capacity.token_capacity, capacity.query_tile,
        flat_rows.zero_per_tile(capacity.token_capacity, capacity.num_tiles), capacity.custom_mask,
    )  # fmt: skip


def _power_of_two_parts(offset: int, width: int) -> list[tuple[int, int]]:
    """``(offset, width)`` cut into power-of-two widths, largest first (192: 128 + 64)."""
    parts = []
    while width:
        part = 1 << (width.bit_length() - 1)
        parts.append((offset, part))
        offset, width = offset + part, width - part
    return parts


def key_parts(head_dim: int, value_width: int | None) -> tuple[tuple[int, int], ...]:
    """The key's column parts: the head, or (latent) the value columns, then the rest, each
    cut into power-of-two widths.

    Each part is loaded and multiplied on its own: the Triton lowering needs power-of-two
    block widths, and neither an MLA latent row (512 + 64 = 576) nor an MLA decompressed key
    (``qk_nope_head_dim + qk_rope_head_dim`` = 128 + 64) is one.
    """
    if value_width is None or value_width == head_dim:
        return tuple(_power_of_two_parts(0, head_dim))
    return ((0, value_width), *_power_of_two_parts(value_width, head_dim - value_width))


def _visible_range(q_len, q_pos, kv_len, row0, launch: _Launch, causal: bool):
    """One past the furthest KV position a row of the block starting at ``row0`` may see."""
    last_query = jnp.minimum(q_len, lax.div(row0 + launch.block_rows - 1, launch.group) + 1)
    end = jnp.minimum(kv_len, q_pos + last_query) if causal else kv_len
    return jnp.where(lax.div(row0, launch.group) < q_len, end, 0)


def _whole_blocks(start, stop, q_pos, row0, trips, launch: _Launch, block_kv: int, causal: bool):
    """How many leading KV blocks of a split every row of the row block sees whole.

    Those blocks skip the mask (as flash attention does): they lie inside the split and, with
    the causal rule, at or before the block's first query's position, so every later row sees
    them too. Rows past the tile's queries see them as well; their outputs are never stored.
    A custom mask (verify) masks every block.
    """
    if not causal:
        return 0
    first_query = lax.div(row0, launch.group)
    end = jnp.minimum(stop, q_pos + first_query + 1)  # one past the last position all see
    return jnp.clip(lax.div(jnp.maximum(end - start, 0), block_kv), 0, trips)


def _dot(a, b, *, contract_b: int):
    """``a @ b`` (``contract_b=0``) or ``a @ b.T`` (``1``) with float32 accumulation.

    The Triton lowering runs float32 operands in IEEE precision (no TF32), bf16 on the
    tensor cores.
    """
    dims = (((1,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _paged_attention_kernel(
    layer_ref, num_tokens_ref, tile_req_ref, tile_q_start_ref, tile_q_len_ref, tile_q_pos_ref,
    tile_kv_len_ref, req_to_token_ref, q_ref, k_ref, *refs, launch: _Launch, block_kv: int,
    scaling: float,
):  # fmt: skip
    # layer_ref, num_tokens_ref: [1]; tile_*_ref: [num_tiles];
    # req_to_token_ref: [max_reqs, max_context]; q_ref: [tokens * q_heads, head_dim];
    # k_ref: [num_layers, num_slots, kv_heads, head_dim];
    # refs: (v_ref [..., v_head_dim],)? (absent for a latent pool: values are k's first
    # value_width columns), (mask_ref [num_tiles, query_tile, max_context] int8,)? then the
    # outputs: rows in place (launch.stores_rows): o_ref [tokens * q_heads (+
    # flat_rows.SPARE_ROWS in the interpreter), v_head_dim] in q's dtype; else partial rows:
    # o_ref [num_tiles, kv_heads, row_blocks, splits, block_rows, v_head_dim] f32 and
    # lse_ref [..., block_rows] f32.
    refs = list(refs)
    v_ref = refs.pop(0) if launch.value_width is None else None
    mask_ref = refs.pop(0) if launch.custom_mask else None
    o_ref, *lse_ref = refs
    tile, s = pl.program_id(0), pl.program_id(2)
    head, rb = (
        lax.div(pl.program_id(1), launch.row_blocks),
        lax.rem(pl.program_id(1), launch.row_blocks),
    )
    layer, req = layer_ref[0], tile_req_ref[tile]
    q_len, q_pos, kv_len = tile_q_len_ref[tile], tile_q_pos_ref[tile], tile_kv_len_ref[tile]
    max_context = req_to_token_ref.shape[1]
    row0 = rb * launch.block_rows
    row = row0 + jnp.arange(launch.block_rows, dtype=jnp.int32)
    query = lax.div(row, launch.group)
    row_ok = query < q_len  # [block_rows]
    end = _visible_range(q_len, q_pos, kv_len, row0, launch, mask_ref is None)
    split_len = pl.cdiv(pl.cdiv(end, launch.splits), block_kv) * block_kv
    start = s * split_len
    stop = jnp.minimum(start + split_len, end)
    flat_row = flat_rows.flat_rows(
        tile_q_start_ref[tile], head, row, group=launch.group, q_heads=launch.q_heads
    )
    q_parts = flat_rows.load_rows(q_ref, flat_row, launch.key_parts)

    def body(b, carry, *, masked: bool):
        m, denom, acc = carry
        pos = start + b * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        column = jnp.minimum(pos, max_context - 1)
        in_range = pos < stop
        slots = jnp.where(in_range, req_to_token_ref[req, column], kv_cache_lib.PADDING_SLOT)
        k_parts = [k_ref[layer, slots, head, pl.ds(o, w)] for o, w in launch.key_parts]
        # values: [block_kv, v_head_dim]; a latent pool's are its first key part
        v = k_parts[0] if v_ref is None else v_ref[layer, slots, head, :]
        scores = (
            sum(
                _dot(q_part, k_part.astype(q_part.dtype), contract_b=1)
                for q_part, k_part in zip(q_parts, k_parts, strict=True)
            )
            * scaling
        )  # [block_rows, block_kv]
        if masked:
            visible = row_ok[:, None] & in_range[None, :]
            if mask_ref is None:
                visible = visible & (pos[None, :] <= q_pos + query[:, None])
            else:
                row = jnp.minimum(query, mask_ref.shape[1] - 1)
                visible = visible & (mask_ref[tile, row[:, None], column[None, :]] != 0)
            scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=1))
        # A row that has seen no visible key keeps max -inf; shift it by 0 to avoid inf - inf.
        m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(scores - m_shift[:, None])
        correction = jnp.exp(m - m_shift)
        pv = _dot(p.astype(v.dtype), v, contract_b=0)  # [block_rows, v_head_dim]
        return m_new, denom * correction + p.sum(axis=1), acc * correction[:, None] + pv

    init = (
        jnp.full((launch.block_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((launch.block_rows,), jnp.float32),
        jnp.zeros((launch.block_rows, o_ref.shape[-1]), jnp.float32),
    )
    trips = pl.cdiv(jnp.maximum(stop - start, 0), block_kv)
    whole = _whole_blocks(start, stop, q_pos, row0, trips, launch, block_kv, mask_ref is None)
    carry = lax.fori_loop(0, whole, functools.partial(body, masked=False), init)
    m, denom, acc = lax.fori_loop(whole, trips, functools.partial(body, masked=True), carry)
    seen = denom > 0
    safe = jnp.where(seen, denom, 1.0)
    out = jnp.where(seen[:, None], acc / safe[:, None], 0.0)
    if lse_ref:  # partial rows for the merge
        o_ref[tile, head, rb, s] = out
        lse_ref[0][tile, head, rb, s] = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
        return
    flat_rows.store_rows(o_ref, flat_row, out, row_ok)
    flat_rows.zero_padded_rows(
        o_ref, num_tokens_ref[0], tile, head, row, group=launch.group, q_heads=launch.q_heads,
        tokens=launch.tokens, query_tile=launch.query_tile, zero_per_tile=launch.zero_per_tile,
    )  # fmt: skip


def _merge_splits(o, lse):
    """Log-sum-exp merge over the split axis (3): ``[tiles, kvh, row_blocks, rows, dv]``."""
    if o.shape[3] == 1:
        return o[:, :, :, 0]
    top = lse.max(axis=3, keepdims=True)
    weight = jnp.exp(lse - jnp.where(top == -jnp.inf, 0.0, top))  # 0 for empty splits
    total = weight.sum(axis=3)
    merged = (o * weight[..., None]).sum(axis=3)
    return jnp.where(total[..., None] > 0, merged / jnp.where(total > 0, total, 1.0)[..., None], 0)


def _scatter_rows(q, out_rows, md: metadata_lib.AttentionMetadata, launch: _Launch, kv_heads):
    """Writes the tiles' rows back to flat tokens: ``[token_capacity, q_heads, dv]``."""
    tiles, query_tile = md.capacity.num_tiles, md.capacity.query_tile
    dv = out_rows.shape[-1]
    rows = out_rows.reshape(tiles, kv_heads, -1, dv)[:, :, : launch.rows]
    rows = rows.reshape(tiles, kv_heads, query_tile, launch.group, dv).transpose(0, 2, 1, 3, 4)
    row = jnp.arange(query_tile)
    token = md.tile_q_start[:, None] + row[None, :]
    keep = (row[None, :] < md.tile_q_len[:, None]) & (token < md.num_tokens)
    target = jnp.where(keep, token, q.shape[0]).reshape(-1)  # out of range: dropped
    out = jnp.zeros((q.shape[0], q.shape[1], dv), q.dtype)
    values = rows.reshape(-1, q.shape[1], dv).astype(q.dtype)
    return out.at[target].set(values, mode="drop", unique_indices=True)


def _kernel_inputs(q, cache, layer_id, md, config, value_width):
    """The launch shape and the inputs both kernels take first (the Pallas kernel's refs)."""
    kv_heads = cache.k.shape[2]
    launch = _launch(
        config, md.capacity, kv_heads, q.shape[1] // kv_heads, q.shape[-1], value_width
    )
    inputs = [
        jnp.asarray(layer_id, jnp.int32).reshape(1),
        jnp.asarray(md.num_tokens, jnp.int32).reshape(1),
        *(x.astype(jnp.int32) for x in (md.tile_req, md.tile_q_start, md.tile_q_len,
                                        md.tile_q_pos, md.tile_kv_len)),
        cache.req_to_token, q.reshape(-1, q.shape[-1]), cache.k,
    ]  # fmt: skip
    return launch, inputs


def _out_shapes(q, md, cache, launch: _Launch, value_width, extra_rows: int):
    """The kernels' outputs: the attention rows in ``q``'s dtype where the kernel stores them
    in place (``launch.stores_rows``), else per split the normalised rows and their
    log-sum-exp (float32)."""
    dv = cache.v.shape[-1] if value_width is None else value_width
    if launch.stores_rows:
        return (jax.ShapeDtypeStruct((q.shape[0] * q.shape[1] + extra_rows, dv), q.dtype),)
    lead = (md.capacity.num_tiles, cache.k.shape[2], launch.row_blocks, launch.splits,
            launch.block_rows)  # fmt: skip
    return (
        jax.ShapeDtypeStruct((*lead, dv), jnp.float32),
        jax.ShapeDtypeStruct(lead, jnp.float32),
    )


def _finish(q, outs, md, launch: _Launch, kv_heads: int):
    """``[token_capacity, q_heads, dv]`` from the kernels' outputs: the rows as stored, or the
    splits merged and scattered to their tokens."""
    if launch.stores_rows:
        return outs[0][: q.shape[0] * q.shape[1]].reshape(*q.shape[:2], -1)
    o, lse = outs
    return _scatter_rows(q, _merge_splits(o, lse), md, launch, kv_heads)


def paged_attention_pallas(
    q, cache, layer_id, md, *, scaling, config, interpret, value_width=None
):  # fmt: skip
    """Pallas impl: the kernel, the split merge and the row scatter (see the module docstring).

    ``value_width``: None reads values from ``cache.v``; an int reads them from the first
    ``value_width`` columns of ``cache.k`` (an MLA latent pool, ``cache.v`` unread).
    """
    launch, inputs = _kernel_inputs(q, cache, layer_id, md, config, value_width)
    if value_width is None:
        inputs.append(cache.v)
    if md.custom_mask is not None:
        inputs.append(md.custom_mask.astype(jnp.int8))
    kernel = functools.partial(
        _paged_attention_kernel, launch=launch, block_kv=config.block_kv, scaling=scaling
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=_out_shapes(
            q, md, cache, launch, value_width, flat_rows.SPARE_ROWS if interpret else 0
        ),
        grid=(md.capacity.num_tiles, cache.k.shape[2] * launch.row_blocks, launch.splits),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        name="jtbo_paged_attention",
    )(*inputs)
    return _finish(q, outs, md, launch, cache.k.shape[2])


def paged_attention_triton(q, cache, layer_id, md, *, scaling, config, value_width=None):
    """jax-triton impl: ``triton_kernels.jtbo_paged_attention_kernel`` (the Pallas kernel's
    algorithm in Triton), its outputs finished as the Pallas kernel's (``_finish``)."""
    from jtbo.attention import triton_kernels  # imports triton: GPU machines only

    launch, inputs = _kernel_inputs(q, cache, layer_id, md, config, value_width)
    kv_heads, (key0, key1) = cache.k.shape[2], triton_parts(launch.key_parts)
    values = cache.v if value_width is None else cache.k  # latent: values are k's columns
    mask = md.custom_mask
    mask = jnp.zeros((1,), jnp.int8) if mask is None else mask.astype(jnp.int8)
    dv = cache.v.shape[-1] if value_width is None else value_width
    outs = _out_shapes(q, md, cache, launch, value_width, 0)
    if launch.stores_rows:  # the kernel's log-sum-exp output goes unread: one placeholder
        outs = (*outs, jax.ShapeDtypeStruct((1,), jnp.float32))
    outs = impls.jax_triton().triton_call(
        *inputs, values, mask,
        kernel=triton_kernels.jtbo_paged_attention_kernel,
        out_shape=outs,
        grid=(md.capacity.num_tiles, kv_heads * launch.row_blocks, launch.splits),
        num_warps=config.num_warps,
        num_stages=triton_stages(config.num_stages, config.block_kv, key0 + key1 + dv,
                                 cache.k.dtype.itemsize),
        SCALE_LOG2=scaling * math.log2(math.e), NUM_SLOTS=cache.k.shape[1], KV_HEADS=kv_heads,
        MAX_CONTEXT=cache.req_to_token.shape[1], QUERY_TILE=md.capacity.query_tile,
        GROUP=launch.group, ROW_BLOCKS=launch.row_blocks, BLOCK_ROWS=launch.block_rows,
        SPLITS=launch.splits, BLOCK_KV=config.block_kv, KEY0=key0, KEY1=key1, DV=dv,
        V_ROW=values.shape[-1], HAS_MASK=md.custom_mask is not None,
        PADDING_SLOT=kv_cache_lib.PADDING_SLOT, PREC=triton_precision(q.dtype),
        Q_HEADS=launch.q_heads, TOKENS=launch.tokens, ZERO_PER_TILE=launch.zero_per_tile,
        STORES_ROWS=launch.stores_rows,
    )  # fmt: skip
    return _finish(q, outs[: 1 if launch.stores_rows else 2], md, launch, kv_heads)


TRITON_SHARED_MEMORY_BYTES = 232448
"""Shared memory one program may use on an H100 / H200 (227 KiB; the launch fails above it)."""


def triton_stages(num_stages: int, block_kv: int, row_width: int, itemsize: int) -> int:
    """The Triton kernels' pipelining depth: ``num_stages`` at most, fewer where that many
    staged K/V blocks would not fit in shared memory.

    Triton keeps one copy of each loop load per stage: ``block_kv`` K/V rows of ``row_width``
    elements together (key and value columns). A quarter more is left for the kernel's own
    buffers. MLA's latent rows (512 + 64 key and 512 value columns) fit one stage of 64 rows.

    Raises:
      KernelUnavailableError: not even one stage fits.
    """
    per_stage = block_kv * row_width * itemsize
    fits = TRITON_SHARED_MEMORY_BYTES // (per_stage + per_stage // 4)
    if fits < 1:
        raise impls.KernelUnavailableError(
            f"impl='triton' is unavailable: a block of {block_kv} K/V rows of {row_width} "
            f"elements needs {per_stage} bytes of shared memory per stage, more than the "
            f"{TRITON_SHARED_MEMORY_BYTES} a program may use; lower block_kv"
        )
    return min(num_stages, fits)


def triton_parts(parts: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The Triton kernels' ``(KEY0, KEY1)`` column widths of ``key_parts`` (``KEY1 = 0``: one
    part); ``unavailable_reason`` rules out more than two."""
    widths = [width for _, width in parts]
    return widths[0], (widths[1] if len(widths) > 1 else 0)


def triton_precision(dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: float32 in IEEE precision
    (as the Pallas lowering and XLA's float32 dots on the CPU), else the tensor cores'
    default."""
    return "ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32"


def unavailable_reason(q, cache, value_width=None, impl: str = "pallas") -> str | None:
    """Why the ``impl`` kernel cannot take these shapes: the Triton blocks of both kernels are
    powers of two >= 16, and the ``"triton"`` kernels load a key in at most two parts."""
    parts = key_parts(q.shape[-1], value_width)
    sizes = [(f"head_dim part [{o}:{o + w}]", w) for o, w in parts]
    if value_width is None:
        sizes.append(("v_head_dim", cache.v.shape[-1]))
    for name, size in sizes:
        if size < 16 or not launch_checks.is_power_of_two(size):
            return f"{name} = {size} is not a power of two >= 16"
    if impl == "triton" and len(parts) > 2:
        return f"the key's {len(parts)} power-of-two parts {parts} exceed the Triton kernels' two"
    return None


def check_heads(q, cache) -> None:
    """Raises ValueError when the query heads are not a multiple of the pool's KV heads."""
    if q.shape[1] % cache.k.shape[2]:
        raise ValueError(
            f"q_heads = {q.shape[1]} is not a multiple of kv_heads = {cache.k.shape[2]}"
        )


def resolve_kernel_impl(
    impl: str | None, *, op: str, q, cache, value_width=None
) -> tuple[str, bool]:
    """The impl of an attention op, and whether its Pallas kernel runs in the interpreter.

    Args:
      impl: as ``paged_attention``'s.
      op: the op's key in ``jtbo.kernels.impls.FASTEST``.
      q: the queries (their widths decide whether the kernels' tiles fit).
      cache: the pool read.
      value_width: as ``paged_attention``'s.

    Returns:
      ``(impl, interpret)``: ``"xla"``, ``"pallas"`` or ``"triton"``, and True where the
      Pallas kernel runs in the interpreter (the CPU).

    Raises:
      ValueError: an unknown impl.
      KernelUnavailableError: ``"triton"`` off GPUs or without jax-triton, or a kernel impl
        on a GPU for shapes its tiles cannot take.
    """
    impl = impls.resolve(impl, op=op)
    interpret = impls.backend() == "cpu"
    needs_tiles = impl == "triton" or (impl == "pallas" and not interpret)
    reason = unavailable_reason(q, cache, value_width, impl) if needs_tiles else None
    if reason is not None:
        raise impls.KernelUnavailableError(f"impl={impl!r} is unavailable: {reason}")
    return impl, interpret


def latent_view(value_width: int) -> native.KVView:
    """Reads a latent pool's rows as one key head and their first ``value_width`` values as
    the value head (MLA's absorbed form)."""
    return native.KVView(1, value_width, lambda k, v: (k, k[..., :value_width]))


def paged_attention(
    q: jax.Array,
    cache: kv_cache_lib.KVCache,
    layer_id: int | jax.Array,
    md: metadata_lib.AttentionMetadata,
    *,
    scaling: float,
    impl: str | None = None,
    config: PagedAttentionConfig = DEFAULT_CONFIG,
    native_config: native.NativeAttentionConfig = native.DEFAULT_CONFIG,
    value_width: int | None = None,
) -> jax.Array:
    """Attends every tile's queries over its sequence's cached K/V (already written).

    Args:
      q: queries, ``[token_capacity, q_heads, head_dim]``.
      cache: the KV cache, holding this step's new tokens already.
      layer_id: layer whose pool is read (static int or traced scalar).
      md: the step's metadata.
      scaling: factor applied to ``q . k``.
      impl: ``"xla"`` (the native backend's blocked jnp attention, the reference),
        ``"pallas"`` (this module's kernel; the interpreter on the CPU), ``"triton"`` (the
        same algorithm as a Triton kernel through jax-triton; GPUs only) or None (the fastest
        available, ``jtbo.kernels.impls.FASTEST``).
      config: the kernel's launch shape (``"pallas"`` and ``"triton"``).
      native_config: the native attention's knobs (``"xla"``).
      value_width: None: values from ``cache.v``. An int: ``cache`` is an MLA latent pool
        (one KV head of latent rows, ``cache.v`` unread), the values are each row's first
        ``value_width`` columns (MLA's absorbed form), and ``impl=None`` follows
        ``LATENT_OP``'s order.

    Returns:
      ``[token_capacity, q_heads, v_head_dim]`` (``value_width`` when given) in ``q.dtype``;
      zeros for rows without keys and rows past ``md.num_tokens``.

    Raises:
      ValueError: an unknown impl, or q heads not a multiple of the KV heads.
      KernelUnavailableError: the named impl cannot serve this call here.
    """
    check_heads(q, cache)
    impl, interpret = resolve_kernel_impl(
        impl, op=OP if value_width is None else LATENT_OP, q=q, cache=cache,
        value_width=value_width,
    )  # fmt: skip
    if impl == "xla":
        view = None if value_width is None else latent_view(value_width)
        return native.attend(
            q, cache, layer_id, md, scaling=scaling, config=native_config, view=view
        )
    if impl == "triton":
        return paged_attention_triton(
            q, cache, layer_id, md, scaling=scaling, config=config, value_width=value_width
        )
    return paged_attention_pallas(
        q, cache, layer_id, md, scaling=scaling, config=config, interpret=interpret,
        value_width=value_width,
    )  # fmt: skip


def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layer_id: int | jax.Array,
    md: metadata_lib.AttentionMetadata,
    cache: kv_cache_lib.KVCache,
    *,
    scaling: float | None = None,
    impl: str | None = None,
    config: PagedAttentionConfig = DEFAULT_CONFIG,
) -> tuple[jax.Array, kv_cache_lib.KVCache]:
    """Writes the step's K/V at ``out_cache_loc`` and attends with ``paged_attention``.

    Args:
      q: queries, ``[token_capacity, q_heads, head_dim]``.
      k: new keys, ``[token_capacity, kv_heads, head_dim]``.
      v: new values, ``[token_capacity, kv_heads, v_head_dim]``.
      layer_id: layer index.
      md: the step's metadata.
      cache: the KV cache (donate it to update in place).
      scaling: score scale; ``head_dim ** -0.5`` when None.
      impl: as ``paged_attention``.
      config: the kernel's launch shape.

    Returns:
      ``(out [token_capacity, q_heads, v_head_dim], new cache)``.

    Raises:
      ValueError: shapes that disagree (``native.write_step_kv``) or an unknown impl.
      KernelUnavailableError: the named impl cannot serve this call here.
    """
    cache = native.write_step_kv(q, k, v, layer_id, md, cache)
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    out = paged_attention(q, cache, layer_id, md, scaling=scaling, impl=impl, config=config)
    return out, cache
