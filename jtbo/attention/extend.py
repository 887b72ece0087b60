"""Causal extend attention in two stages: the prefix from the pool, the step's tokens as given.

An EXTEND (or MIXED) step's query at flat token ``t`` of a sequence sees two kinds of keys:

1. **prefix**: the KV positions ``[0, prefix_len)`` the sequence had before this step. They
   live in the pool, scattered over slots, so they are read through the page table, as the
   paged kernel (``jtbo.attention.paged``) reads them. Every query of the step sees all of them.
2. **extend**: the step's own new tokens of the sequence. They are contiguous in the flat
   ``k`` / ``v`` arrays the layer just computed (flat tokens ``[new_start, t]``, causal), so
   they are read from there directly: no page-table load, and no wait on the pool write.

SGLang's Triton ``extend_attention`` splits the work the same way. Here one program
runs both stages for one (query tile, KV head, row block) with one online softmax (running
max, denominator and weighted values in float32, exponentials in base 2), so nothing is merged
afterwards and the result goes straight to the output's token rows in ``q.dtype``.

* **Rows.** A program's matrix rows are (query, group head) pairs, row ``r`` = query
  ``r // group`` and head ``r % group`` of the KV head's group (as in the paged kernel), loaded
  from and stored to the flat ``[tokens * q_heads, dim]`` views of ``q`` and the output, so
  neither is gathered nor scattered by XLA. Rows past the tile's queries are not stored. The
  padded tokens' rows (from ``num_tokens`` on) are zeroed by the programs too, each tile's
  programs a share of them, so the output needs no zero fill beforehand.
* **Masks.** Blocks every row sees whole skip the mask: all prefix blocks but a partial last
  one, and the extend blocks up to the row block's first query. The rest are masked by range
  (prefix) or by the causal rule (extend).
* **The K/V write.** The programs of a tile's first row block also store the tile's tokens'
  K/V rows of their KV head at the tokens' pool slots (``out_cache_loc``; the pools are
  aliased outputs, updated in place). No program reads those slots in this call (prefixes
  hold only older positions), so the step needs no separate scatter into the pool.
* **Order.** The grid is (KV heads x row blocks, tiles), tiles taken from the last: a
  prompt's later tiles see more keys, so the heavy programs start first and light ones fill
  the last wave.
* **Metadata.** A tile's ``prefix_len`` is its sequence's smallest ``tile_q_pos``
  (``metadata.tile_prefix_lens``) and its ``new_start`` the flat token of that position;
  both come from the step's tile metadata (one sequence per page-table row per step, as the
  runner builds it).

The step's K/V are cast to the pool's dtype first, so both stages attend over the values the
pool holds. ``impl="pallas"`` is the kernel in Pallas (Triton lowering; the interpreter on the
CPU), ``impl="triton"`` the same kernel in Triton's language through jax-triton
(``triton_kernels.jtbo_extend_attention_kernel``), and ``impl="xla"`` the pool write followed
by the native attention over the pool (the reference).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.attention import flat_rows, native, paged
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.attention import metadata as metadata_lib
from jtbo.kernels import impls, launch_checks

OP = "extend_attention"
"""This op's key in ``jtbo.kernels.impls.FASTEST``."""


@dataclasses.dataclass(frozen=True)
class ExtendAttentionConfig:
    """Launch shape of the extend attention kernel.

    Attributes:
      block_kv: KV positions per loop step, in both stages (a power of two, at least 16).
      block_rows: most matrix rows (query rows x group heads) per program (a power of two,
        at least 16).
      num_warps: warps per program (a power of two).
      num_stages: software-pipelining stages Triton may use for the KV loops (the
        ``"triton"`` impl uses fewer where the staged K/V blocks would not fit in shared
        memory: ``paged.triton_stages``).
    """

    block_kv: int = 64
    block_rows: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        launch_checks.require_powers_of_two(self, ("block_kv", "block_rows", "num_warps"))
        launch_checks.require_at_least(self, ("block_kv", "block_rows"), 16)
        launch_checks.require_at_least(self, ("num_stages",), 1)


DEFAULT_CONFIG = ExtendAttentionConfig()
"""The kernel knobs used when none are given: the fastest launch shape of the H200 sweeps in
docs/benchmarks/, "Attention: the extend kernel"."""


@dataclasses.dataclass(frozen=True)
class _Launch:
    """Static launch shape of one call."""

    group: int  # query heads per KV head
    q_heads: int
    tokens: int  # token_capacity
    query_tile: int
    zero_per_tile: int  # padded tokens whose output rows each tile's programs zero
    write_rows: int  # the tile's token rows its K/V write covers (query_tile, power of two)
    block_rows: int
    row_blocks: int
    block_kv: int
    key_parts: tuple[tuple[int, int], ...]  # (offset, width) column parts of q and k


def _launch(config: ExtendAttentionConfig, capacity, q_heads, kv_heads, head_dim):
    rows = capacity.query_tile * (q_heads // kv_heads)
    block_rows = min(config.block_rows, max(16, pl.next_power_of_2(rows)))
    return _Launch(
        q_heads // kv_heads, q_heads, capacity.token_capacity, capacity.query_tile,
        flat_rows.zero_per_tile(capacity.token_capacity, capacity.num_tiles),
        max(16, pl.next_power_of_2(capacity.query_tile)), block_rows,
        pl.cdiv(rows, block_rows), config.block_kv, paged.key_parts(head_dim, None),
    )  # fmt: skip


def _softmax_step(carry, scores, v):
    """One online-softmax step over a KV block (``scores`` in base 2, masked keys -inf)."""
    m, denom, acc = carry
    m_new = jnp.maximum(m, scores.max(axis=1))
    # A row that has seen no visible key keeps max -inf; shift it by 0 to avoid inf - inf.
    m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(scores - m_shift[:, None])
    correction = jnp.exp2(m - m_shift)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    return m_new, denom * correction + p.sum(axis=1), acc * correction[:, None] + pv


def _scores(q_parts, k_parts, scale_log2):
    """``q . k`` over the key's column parts, times ``scaling * log2(e)``: ``[rows, block_kv]``."""
    dims = (((1,), (1,)), ((), ()))
    total = sum(
        lax.dot_general(qp, kp.astype(qp.dtype), dims, preferred_element_type=jnp.float32)
        for qp, kp in zip(q_parts, k_parts, strict=True)
    )
    return total * scale_log2


def _write_step_rows(loc_ref, k_ref, v_ref, k_out_ref, v_out_ref, layer, q_start, q_len,
                     num_tokens, head, launch: _Launch):  # fmt: skip
    """Stores the tile's tokens' K/V rows of KV head ``head`` into the pool at their slots
    (``out_cache_loc``); tokens past the tile's queries or ``num_tokens``, and tokens whose
    slot is the padding slot, are not written (as ``kv_cache.write_kv`` drops them)."""
    offset = jnp.arange(launch.write_rows, dtype=jnp.int32)
    token = q_start + offset
    loaded = jnp.minimum(token, launch.tokens - 1)
    slot = loc_ref[loaded]
    keep = (offset < q_len) & (token < num_tokens) & (slot != kv_cache_lib.PADDING_SLOT)
    # Masked-off rows aim at the padding slot, which no kept row writes: the interpreter's
    # masked store writes back what it read there.
    slot = jnp.where(keep, slot, kv_cache_lib.PADDING_SLOT)
    # Keys in the kernel's power-of-two column parts, values whole.
    parts = [(k_ref, k_out_ref, o, w) for o, w in launch.key_parts]
    for src_ref, out_ref, offset, width in [*parts, (v_ref, v_out_ref, 0, v_ref.shape[-1])]:
        column = offset + jnp.arange(width, dtype=jnp.int32)[None, :]
        rows = src_ref[loaded, head, pl.ds(offset, width)]
        mask = jnp.broadcast_to(keep[:, None], rows.shape)
        plgpu.store(out_ref.at[layer, slot[:, None], head, column], rows, mask=mask)


def _extend_attention_kernel(
    layer_ref, num_tokens_ref, tile_req_ref, tile_q_start_ref, tile_q_len_ref,
    tile_prefix_ref, tile_new_start_ref, req_to_token_ref, q_ref, k_pool_ref, v_pool_ref,
    k_ref, v_ref, loc_ref, o_ref, k_out_ref, v_out_ref, *, launch: _Launch, scale_log2: float,
):  # fmt: skip
    # layer_ref, num_tokens_ref: [1]; tile_*_ref: [num_tiles];
    # req_to_token_ref: [max_reqs, max_context]; q_ref: [tokens * q_heads, head_dim];
    # k_pool_ref: [layers, slots, kv_heads, head_dim]; v_pool_ref: [layers, slots, kv_heads,
    # v_head_dim]; k_ref: [tokens, kv_heads, head_dim]; v_ref: [tokens, kv_heads, v_head_dim];
    # loc_ref: [tokens] (out_cache_loc); o_ref: [tokens * q_heads (+ flat_rows.SPARE_ROWS in the
    # interpreter), v_head_dim] in q's dtype; k_out_ref / v_out_ref: the pools (aliased).
    # Grid (kv_heads * row_blocks, num_tiles), tiles from the last: a prompt's later tiles see
    # more keys, so the heavy programs start first and light ones fill the last wave.
    tile = pl.num_programs(1) - 1 - pl.program_id(1)
    head = lax.div(pl.program_id(0), launch.row_blocks)
    row_block = lax.rem(pl.program_id(0), launch.row_blocks)
    row0 = row_block * launch.block_rows
    q_start, q_len = tile_q_start_ref[tile], tile_q_len_ref[tile]
    prefix, new_start = tile_prefix_ref[tile], tile_new_start_ref[tile]
    row = row0 + jnp.arange(launch.block_rows, dtype=jnp.int32)
    query = lax.div(row, launch.group)
    row_ok = query < q_len  # [block_rows]
    flat_row = flat_rows.flat_rows(q_start, head, row, group=launch.group, q_heads=launch.q_heads)
    q_parts = flat_rows.load_rows(q_ref, flat_row, launch.key_parts)
    first_query = lax.div(row0, launch.group)
    real = first_query < q_len
    block = launch.block_kv
    offsets = jnp.arange(block, dtype=jnp.int32)

    def prefix_body(b, carry, *, masked: bool):
        pos = b * block + offsets
        column = jnp.minimum(pos, req_to_token_ref.shape[1] - 1)
        slots = jnp.where(
            pos < prefix, req_to_token_ref[tile_req_ref[tile], column], kv_cache_lib.PADDING_SLOT
        )
        layer = layer_ref[0]
        k_parts = [k_pool_ref[layer, slots, head, pl.ds(o, w)] for o, w in launch.key_parts]
        scores = _scores(q_parts, k_parts, scale_log2)
        if masked:
            scores = jnp.where((pos < prefix)[None, :], scores, -jnp.inf)
        return _softmax_step(carry, scores, v_pool_ref[layer, slots, head, :])

    def extend_body(b, carry, *, masked: bool):
        token = new_start + b * block + offsets
        loaded = jnp.minimum(token, k_ref.shape[0] - 1)
        k_parts = [k_ref[loaded, head, pl.ds(o, w)] for o, w in launch.key_parts]
        scores = _scores(q_parts, k_parts, scale_log2)
        if masked:
            visible = token[None, :] <= (q_start + query)[:, None]
            scores = jnp.where(visible, scores, -jnp.inf)
        return _softmax_step(carry, scores, v_ref[loaded, head, :])

    carry = (
        jnp.full((launch.block_rows,), -jnp.inf, jnp.float32),
        jnp.zeros((launch.block_rows,), jnp.float32),
        jnp.zeros((launch.block_rows, o_ref.shape[-1]), jnp.float32),
    )
    prefix_end = jnp.where(real, prefix, 0)
    whole = lax.div(prefix_end, block)
    carry = lax.fori_loop(0, whole, functools.partial(prefix_body, masked=False), carry)
    trips = pl.cdiv(prefix_end, block)
    carry = lax.fori_loop(whole, trips, functools.partial(prefix_body, masked=True), carry)
    # Extend keys: flat tokens [new_start, one past the block's last query).
    last_query = jnp.minimum(q_len, lax.div(row0 + launch.block_rows - 1, launch.group) + 1)
    new_len = jnp.where(real, q_start + last_query - new_start, 0)
    trips = pl.cdiv(new_len, block)
    whole = jnp.clip(lax.div(q_start + first_query + 1 - new_start, block), 0, trips)
    carry = lax.fori_loop(0, whole, functools.partial(extend_body, masked=False), carry)
    _, denom, acc = lax.fori_loop(whole, trips, functools.partial(extend_body, masked=True), carry)
    flat_rows.store_rows(o_ref, flat_row, acc / jnp.where(denom > 0, denom, 1.0)[:, None], row_ok)
    flat_rows.zero_padded_rows(
        o_ref, num_tokens_ref[0], tile, head, row, group=launch.group, q_heads=launch.q_heads,
        tokens=launch.tokens, query_tile=launch.query_tile, zero_per_tile=launch.zero_per_tile,
    )  # fmt: skip

    @pl.when(row_block == 0)
    def _():
        _write_step_rows(loc_ref, k_ref, v_ref, k_out_ref, v_out_ref, layer_ref[0], q_start,
                         q_len, num_tokens_ref[0], head, launch)  # fmt: skip


def _tile_prefixes(md: metadata_lib.AttentionMetadata, num_reqs: int):
    """Per tile: its sequence's prefix length and the flat token of the first new position."""
    prefix = metadata_lib.tile_prefix_lens(md, num_reqs)
    return prefix, (md.tile_q_start - (md.tile_q_pos - prefix)).astype(jnp.int32)


def _kernel_inputs(q, k, v, cache, layer_id, md):
    """The inputs both kernels take, in their order (the Pallas kernel's refs); the pools are
    ``POOL_INPUTS``."""
    tokens, q_heads, head_dim = q.shape
    prefix, new_start = _tile_prefixes(md, cache.req_to_token.shape[0])
    return [
        jnp.asarray(layer_id, jnp.int32).reshape(1),
        jnp.asarray(md.num_tokens, jnp.int32).reshape(1), md.tile_req.astype(jnp.int32),
        md.tile_q_start.astype(jnp.int32), md.tile_q_len.astype(jnp.int32), prefix, new_start,
        cache.req_to_token,
        q.reshape(tokens * q_heads, head_dim), cache.k, cache.v,
        k.astype(cache.k.dtype), v.astype(cache.v.dtype), md.out_cache_loc.astype(jnp.int32),
    ]  # fmt: skip


POOL_INPUTS = (9, 10)
"""The K and V pools' places among the kernels' inputs; outputs 1 and 2 alias them (the
kernels write the step's K/V in place)."""


def _out_shapes(q, cache, extra_rows: int):
    """The kernels' outputs: the attention rows, then the K and V pools (aliased)."""
    tokens, q_heads, _ = q.shape
    return (
        jax.ShapeDtypeStruct((tokens * q_heads + extra_rows, cache.v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct(cache.k.shape, cache.k.dtype),
        jax.ShapeDtypeStruct(cache.v.shape, cache.v.dtype),
    )


def _grid(md, kv_heads: int, launch: _Launch) -> tuple[int, int]:
    """(KV heads x row blocks, tiles): the kernels run a prompt's heavy tiles first."""
    return kv_heads * launch.row_blocks, md.capacity.num_tiles


def extend_attention_pallas(q, k, v, cache, layer_id, md, *, scaling, config, interpret):
    """Pallas impl: the two-stage kernel (see the module docstring); returns ``(out, cache)``."""
    tokens, q_heads, head_dim = q.shape
    kv_heads, dv = cache.k.shape[2], cache.v.shape[-1]
    launch = _launch(config, md.capacity, q_heads, kv_heads, head_dim)
    impls.check_pallas_elems(
        [tokens * q_heads * max(head_dim, dv), cache.k.size, cache.v.size],
        launch.block_rows * max(head_dim, dv),
    )
    kernel = functools.partial(
        _extend_attention_kernel, launch=launch, scale_log2=scaling * math.log2(math.e)
    )
    out, k_pool, v_pool = pl.pallas_call(
        kernel,
        out_shape=_out_shapes(q, cache, flat_rows.SPARE_ROWS if interpret else 0),
        grid=_grid(md, kv_heads, launch),
        input_output_aliases={POOL_INPUTS[0]: 1, POOL_INPUTS[1]: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps, num_stages=config.num_stages
        ),
        name="jtbo_extend_attention",
    )(*_kernel_inputs(q, k, v, cache, layer_id, md))
    out = out[: tokens * q_heads].reshape(tokens, q_heads, dv)
    return out, dataclasses.replace(cache, k=k_pool, v=v_pool)


def extend_attention_triton(q, k, v, cache, layer_id, md, *, scaling, config):
    """jax-triton impl: ``triton_kernels.jtbo_extend_attention_kernel``, the Pallas kernel's
    algorithm in Triton (64-bit offsets, so no element-count limit); returns ``(out, cache)``."""
    from jtbo.attention import triton_kernels  # imports triton: GPU machines only

    tokens, q_heads, head_dim = q.shape
    kv_heads, dv = cache.k.shape[2], cache.v.shape[-1]
    launch = _launch(config, md.capacity, q_heads, kv_heads, head_dim)
    key0, key1 = paged.triton_parts(launch.key_parts)
    out, k_pool, v_pool = impls.jax_triton().triton_call(
        *_kernel_inputs(q, k, v, cache, layer_id, md),
        kernel=triton_kernels.jtbo_extend_attention_kernel,
        out_shape=_out_shapes(q, cache, 0),
        grid=_grid(md, kv_heads, launch),
        input_output_aliases={POOL_INPUTS[0]: 1, POOL_INPUTS[1]: 2},
        num_warps=config.num_warps,
        num_stages=paged.triton_stages(config.num_stages, config.block_kv, head_dim + dv,
                                       cache.k.dtype.itemsize),
        SCALE_LOG2=scaling * math.log2(math.e), NUM_SLOTS=cache.k.shape[1], KV_HEADS=kv_heads,
        MAX_CONTEXT=cache.req_to_token.shape[1], TOKENS=tokens,
        QUERY_TILE=launch.query_tile, ZERO_PER_TILE=launch.zero_per_tile,
        WRITE_ROWS=launch.write_rows, GROUP=launch.group, ROW_BLOCKS=launch.row_blocks,
        BLOCK_ROWS=launch.block_rows, BLOCK_KV=launch.block_kv, KEY0=key0, KEY1=key1, DV=dv,
        PADDING_SLOT=kv_cache_lib.PADDING_SLOT, PREC=paged.triton_precision(q.dtype),
    )  # fmt: skip
    return out.reshape(tokens, q_heads, dv), dataclasses.replace(cache, k=k_pool, v=v_pool)


def _check_extend_inputs(q, k, v, cache: kv_cache_lib.KVCache, md) -> None:
    """``extend_attention``'s checks of its metadata and step shapes.

    Raises:
      ValueError: custom-mask metadata, or step q/k/v whose shapes disagree with the
        metadata or the pool.
    """
    if md.custom_mask is not None:
        raise ValueError("extend_attention is causal; custom-mask (verify) metadata goes to "
                         "paged.paged_attention")  # fmt: skip
    native.check_step_shapes(q, k, cache, md)
    if k.shape[1:] != cache.k.shape[2:] or v.shape[1:] != cache.v.shape[2:]:
        raise ValueError(
            f"step k {k.shape} / v {v.shape} do not match the pool's rows "
            f"k {cache.k.shape[2:]} / v {cache.v.shape[2:]}"
        )


def extend_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: kv_cache_lib.KVCache,
    layer_id: int | jax.Array,
    md: metadata_lib.AttentionMetadata,
    *,
    scaling: float,
    impl: str | None = None,
    config: ExtendAttentionConfig = DEFAULT_CONFIG,
    native_config: native.NativeAttentionConfig = native.DEFAULT_CONFIG,
) -> tuple[jax.Array, kv_cache_lib.KVCache]:
    """Writes the step's K/V into the pool and attends causal tiles over their prefix in the
    pool and the step's own K/V.

    The kernels write the K/V themselves (each tile's first row block, its tokens' rows of
    its KV head) while they attend, so the step needs no separate scatter into the pool;
    ``"xla"`` writes with ``native.write_step_kv`` and then attends over the pool.

    Args:
      q: queries, ``[token_capacity, q_heads, head_dim]``.
      k: the step's keys, ``[token_capacity, kv_heads, head_dim]``.
      v: the step's values, ``[token_capacity, kv_heads, v_head_dim]``.
      cache: the KV cache before this step's tokens (donate it to update in place).
      layer_id: layer written and read (static int or traced scalar).
      md: the step's metadata, causal (no custom mask).
      scaling: factor applied to ``q . k``.
      impl: ``"xla"`` (the write, then the native attention over the pool: the reference),
        ``"pallas"`` (this module's kernel; the interpreter on the CPU), ``"triton"`` (the same
        algorithm as a Triton kernel through jax-triton; GPUs only) or None (the fastest
        available, ``jtbo.kernels.impls.FASTEST``).
      config: the kernel's launch shape (``"pallas"`` and ``"triton"``).
      native_config: the native attention's knobs (``"xla"``).

    Returns:
      ``(out, cache)``: ``[token_capacity, q_heads, v_head_dim]`` in ``q.dtype`` (zeros for
      rows past ``md.num_tokens``), and the cache holding the step's real tokens' K/V at
      ``md.out_cache_loc`` (padded tokens and padding-slot targets are not written).

    Raises:
      ValueError: custom-mask metadata, q heads not a multiple of the KV heads, or step
        q/k/v whose shapes disagree with the metadata or the pool.
      KernelUnavailableError: the named impl cannot serve this call here.
    """
    _check_extend_inputs(q, k, v, cache, md)
    impl, interpret = paged.resolve_kernel_impl(impl, op=OP, q=q, cache=cache)
    if impl == "xla":
        cache = native.write_step_kv(q, k, v, layer_id, md, cache)
        out = native.attend(q, cache, layer_id, md, scaling=scaling, config=native_config)
        return out, cache
    if impl == "triton":
        return extend_attention_triton(q, k, v, cache, layer_id, md, scaling=scaling, config=config)
    return extend_attention_pallas(
        q, k, v, cache, layer_id, md, scaling=scaling, config=config, interpret=interpret
    )


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
    config: ExtendAttentionConfig = DEFAULT_CONFIG,
) -> tuple[jax.Array, kv_cache_lib.KVCache]:
    """``extend_attention`` in the backends' argument order, ``scaling`` defaulting to
    ``head_dim ** -0.5``.

    Args:
      q: queries, ``[token_capacity, q_heads, head_dim]``.
      k: new keys, ``[token_capacity, kv_heads, head_dim]``.
      v: new values, ``[token_capacity, kv_heads, v_head_dim]``.
      layer_id: layer index.
      md: the step's causal metadata.
      cache: the KV cache (donate it to update in place).
      scaling: score scale; ``head_dim ** -0.5`` when None.
      impl: as ``extend_attention``.
      config: the kernel's launch shape.

    Returns:
      ``(out [token_capacity, q_heads, v_head_dim], new cache)``.

    Raises:
      ValueError, KernelUnavailableError: as ``extend_attention``.
    """
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    return extend_attention(q, k, v, cache, layer_id, md, scaling=scaling, impl=impl, config=config)
