"""Triton kernels of the ``"triton"`` attention impl (run through jax-triton; GPUs only).

Imported only when that impl runs: ``import triton`` needs a GPU build. The two kernels
compute what the Pallas kernels beside their wrappers compute (``paged``: decode and verify
tiles, split-K, partial outputs and log-sum-exp per split; ``extend``: the prefix through the
page table and the step's own tokens in one online softmax, rows stored in place), written
in Triton's own language so that the pointer arithmetic, the loads and the loop pipelining
are ours rather than the Pallas lowering's:

* a program's matrix rows are (query, group head) pairs, as in the Pallas kernels, so the
  group's heads share every K/V load;
* a key row is loaded in at most two power-of-two column parts (``KEY0`` then ``KEY1``
  columns; ``KEY1 = 0``: one part): GQA heads are one part, MLA's latent row (512 + 64) and
  decompressed key (128 + 64) two;
* the kernels are named ``jtbo_*`` as the Pallas kernels are, so that profiles (``bench
  attention --kernel-time``) tell them from XLA's kernels;
* pool offsets are computed in 64 bits (a pool may hold more than 2**31 elements);
* scores are scaled by ``scaling * log2(e)`` and exponentiated in base 2; float32 operands
  multiply in IEEE precision (``DOT_PRECISION``), bf16 ones on the tensor cores with float32
  accumulation.
"""

import triton
import triton.language as tl


@triton.jit
def _key_scores(
    q0, q1, k_ptr, row_offset, KEY0: tl.constexpr, KEY1: tl.constexpr, PREC: tl.constexpr
):
    """``q . k`` of a block of key rows starting at ``row_offset`` (int64 element offsets,
    ``[block_kv]``), over the key's one or two column parts: ``[rows, block_kv]`` float32."""
    cols0 = tl.arange(0, KEY0)
    k0 = tl.load(k_ptr + row_offset[:, None] + cols0[None, :])
    scores = tl.dot(q0, tl.trans(k0).to(q0.dtype), input_precision=PREC)
    if KEY1 > 0:
        cols1 = KEY0 + tl.arange(0, KEY1)
        k1 = tl.load(k_ptr + row_offset[:, None] + cols1[None, :])
        scores += tl.dot(q1, tl.trans(k1).to(q1.dtype), input_precision=PREC)
    return scores


@triton.jit
def _softmax_step(m, denom, acc, scores, v, PREC: tl.constexpr):
    """One online-softmax step (``scores`` in base 2, invisible keys -inf)."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # A row that has seen no visible key keeps max -inf; shift it by 0 to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_shift[:, None])
    correction = tl.exp2(m - m_shift)
    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, denom * correction + tl.sum(p, axis=1), acc


@triton.jit
def _load_query_parts(q_ptr, q_row, row_ok, KEY0: tl.constexpr, KEY1: tl.constexpr):
    """The rows' query columns (``q_row``: int64 element offsets of the rows), one or two
    parts; rows not ``row_ok`` read zeros. The second part is a dummy when ``KEY1 = 0``."""
    q0 = tl.load(
        q_ptr + q_row[:, None] + tl.arange(0, KEY0)[None, :], mask=row_ok[:, None], other=0
    )
    if KEY1 > 0:
        cols1 = KEY0 + tl.arange(0, KEY1)
        q1 = tl.load(q_ptr + q_row[:, None] + cols1[None, :], mask=row_ok[:, None], other=0)
    else:
        q1 = q0
    return q0, q1


@triton.jit
def jtbo_paged_attention_kernel(
    layer_ptr,  # [1] int32
    num_tokens_ptr,  # [1] int32
    tile_req_ptr,  # [num_tiles] int32
    tile_q_start_ptr,  # [num_tiles] int32
    tile_q_len_ptr,  # [num_tiles] int32
    tile_q_pos_ptr,  # [num_tiles] int32
    tile_kv_len_ptr,  # [num_tiles] int32
    req_to_token_ptr,  # [max_reqs, max_context] int32
    q_ptr,  # [tokens * q_heads, head_dim]
    k_ptr,  # [num_layers, num_slots, kv_heads, head_dim]
    v_ptr,  # [num_layers, num_slots, kv_heads, v_row]; a latent pool passes k again
    mask_ptr,  # [num_tiles, query_tile, max_context] int8, or [1] unread (HAS_MASK False)
    # STORES_ROWS: [tokens * q_heads, dv] in q's dtype, the rows stored in place. Else:
    # [num_tiles, kv_heads, row_blocks, splits, block_rows, dv] float32 partial rows.
    o_ptr,
    lse_ptr,  # partial rows: [..., block_rows] float32 (natural log); else [1], unread
    SCALE_LOG2: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    MAX_CONTEXT: tl.constexpr,
    QUERY_TILE: tl.constexpr,
    GROUP: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    KEY0: tl.constexpr,
    KEY1: tl.constexpr,
    DV: tl.constexpr,
    V_ROW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PADDING_SLOT: tl.constexpr,
    PREC: tl.constexpr,
    Q_HEADS: tl.constexpr,
    TOKENS: tl.constexpr,
    ZERO_PER_TILE: tl.constexpr,
    STORES_ROWS: tl.constexpr,
):
    """``paged._paged_attention_kernel`` in Triton: one program per (tile, KV head x row
    block, KV split) attends its rows over its split of the tile's visible context, read
    through the page table; writes the rows in place (``STORES_ROWS``) or partial rows and
    their log-sum-exp for the wrapper's merge."""
    tile = tl.program_id(0)
    head = tl.program_id(1) // ROW_BLOCKS
    rb = tl.program_id(1) % ROW_BLOCKS
    split = tl.program_id(2)
    layer = tl.load(layer_ptr)
    req = tl.load(tile_req_ptr + tile)
    q_len = tl.load(tile_q_len_ptr + tile)
    q_pos = tl.load(tile_q_pos_ptr + tile)
    kv_len = tl.load(tile_kv_len_ptr + tile)
    row0 = rb * BLOCK_ROWS
    rows = tl.arange(0, BLOCK_ROWS)
    query = (row0 + rows) // GROUP
    row_ok = query < q_len
    # One past the furthest KV position a row of this block may see (paged._visible_range).
    last_query = tl.minimum(q_len, (row0 + BLOCK_ROWS - 1) // GROUP + 1)
    end = kv_len
    if not HAS_MASK:
        end = tl.minimum(kv_len, q_pos + last_query)
    end = tl.where(row0 // GROUP < q_len, end, 0)
    split_len = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_KV) * BLOCK_KV
    start = split * split_len
    stop = tl.minimum(start + split_len, end)

    key_width = KEY0 + KEY1
    head_row = head * GROUP + (row0 + rows) % GROUP
    flat_row = (tl.load(tile_q_start_ptr + tile) + query).to(tl.int64) * Q_HEADS + head_row
    q0, q1 = _load_query_parts(q_ptr, flat_row * key_width, row_ok, KEY0, KEY1)
    m = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_ROWS,), tl.float32)
    acc = tl.zeros((BLOCK_ROWS, DV), tl.float32)
    positions = tl.arange(0, BLOCK_KV)
    value_cols = tl.arange(0, DV)
    pool_row0 = (layer.to(tl.int64) * NUM_SLOTS) * KV_HEADS + head
    mask_row = (tile * QUERY_TILE + tl.minimum(query, QUERY_TILE - 1)).to(tl.int64) * MAX_CONTEXT
    for block_start in range(start, stop, BLOCK_KV):
        pos = block_start + positions
        in_range = pos < stop
        slots = tl.load(req_to_token_ptr + req.to(tl.int64) * MAX_CONTEXT + pos, mask=in_range,
                        other=PADDING_SLOT)  # fmt: skip
        pool_row = pool_row0 + slots.to(tl.int64) * KV_HEADS
        scores = _key_scores(q0, q1, k_ptr, pool_row * key_width, KEY0, KEY1, PREC) * SCALE_LOG2
        visible = row_ok[:, None] & in_range[None, :]
        if HAS_MASK:
            column = tl.minimum(pos, MAX_CONTEXT - 1)
            bits = tl.load(mask_ptr + mask_row[:, None] + column[None, :])
            visible = visible & (bits != 0)
        else:
            visible = visible & (pos[None, :] <= q_pos + query[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        v = tl.load(v_ptr + (pool_row * V_ROW)[:, None] + value_cols[None, :])
        m, denom, acc = _softmax_step(m, denom, acc, scores, v, PREC)
    seen = denom > 0
    safe = tl.where(seen, denom, 1.0)
    out = tl.where(seen[:, None], acc / safe[:, None], 0.0)
    if STORES_ROWS:  # the rows go straight to their tokens; padded tokens' rows are zeroed
        _store_rows(o_ptr, flat_row, out.to(o_ptr.dtype.element_ty), row_ok, DV)
        _zero_padded_rows(
            o_ptr, tl.load(num_tokens_ptr), tile, query, head_row, Q_HEADS, TOKENS, QUERY_TILE,
            ZERO_PER_TILE, BLOCK_ROWS, DV,
        )  # fmt: skip
    else:
        out_row = (((tile * KV_HEADS + head) * ROW_BLOCKS + rb) * SPLITS + split).to(tl.int64)
        out_row = out_row * BLOCK_ROWS + rows
        tl.store(o_ptr + out_row[:, None] * DV + value_cols[None, :], out)
        # Natural-log LSE for the split merge: (m + log2(denom)) / log2(e).
        lse = tl.where(seen, (m + tl.log2(safe)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + out_row, lse)


@triton.jit
def _zero_padded_rows(
    o_ptr, num_tokens, tile, query, head_row, Q_HEADS: tl.constexpr, TOKENS: tl.constexpr,
    QUERY_TILE: tl.constexpr, ZERO_PER_TILE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    DV: tl.constexpr,
):  # fmt: skip
    """Zeros this program's rows of the padded tokens tile ``tile`` answers for:
    ``ZERO_PER_TILE`` tokens from ``num_tokens + tile * ZERO_PER_TILE`` (``flat_rows``)."""
    zeros = tl.zeros((BLOCK_ROWS, DV), o_ptr.dtype.element_ty)
    for chunk in tl.static_range(0, (ZERO_PER_TILE + QUERY_TILE - 1) // QUERY_TILE):
        offset = chunk * QUERY_TILE + query
        token = num_tokens + tile * ZERO_PER_TILE + offset
        keep = (query < QUERY_TILE) & (offset < ZERO_PER_TILE) & (token < TOKENS)
        _store_rows(o_ptr, token.to(tl.int64) * Q_HEADS + head_row, zeros, keep, DV)


@triton.jit
def _store_rows(o_ptr, flat_row, values, row_ok, DV: tl.constexpr):
    """Stores ``values`` at output rows ``flat_row`` (int64) where ``row_ok``."""
    cols = tl.arange(0, DV)
    tl.store(o_ptr + flat_row[:, None] * DV + cols[None, :], values, mask=row_ok[:, None])


@triton.jit
def _prefix_block(
    m, denom, acc, q0, q1, block_start, prefix_end, table_row, pool_row0, k_pool_ptr,
    v_pool_ptr, SCALE_LOG2: tl.constexpr, KV_HEADS: tl.constexpr, BLOCK_KV: tl.constexpr,
    KEY0: tl.constexpr, KEY1: tl.constexpr, DV: tl.constexpr, MASKED: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """One prefix block: slots from the page table row, K/V rows from the pool."""
    pos = block_start + tl.arange(0, BLOCK_KV)
    in_range = pos < prefix_end
    slots = tl.load(table_row + pos, mask=in_range, other=0)
    pool_row = pool_row0 + slots.to(tl.int64) * KV_HEADS
    scores = _key_scores(q0, q1, k_pool_ptr, pool_row * (KEY0 + KEY1), KEY0, KEY1, PREC)
    scores = scores * SCALE_LOG2
    if MASKED:
        scores = tl.where(in_range[None, :], scores, float("-inf"))
    v = tl.load(v_pool_ptr + (pool_row * DV)[:, None] + tl.arange(0, DV)[None, :])
    return _softmax_step(m, denom, acc, scores, v, PREC)


@triton.jit
def _extend_block(
    m, denom, acc, q0, q1, block_start, token_limit, head, k_ptr, v_ptr,
    SCALE_LOG2: tl.constexpr, TOKENS: tl.constexpr, KV_HEADS: tl.constexpr,
    BLOCK_KV: tl.constexpr, KEY0: tl.constexpr, KEY1: tl.constexpr, DV: tl.constexpr,
    MASKED: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """One block of the step's own tokens (flat tokens from ``block_start``), causal where
    ``MASKED``: row ``r`` sees tokens up to ``token_limit[r]``."""
    token = block_start + tl.arange(0, BLOCK_KV)
    loaded = tl.minimum(token, TOKENS - 1).to(tl.int64) * KV_HEADS + head
    scores = _key_scores(q0, q1, k_ptr, loaded * (KEY0 + KEY1), KEY0, KEY1, PREC) * SCALE_LOG2
    if MASKED:
        scores = tl.where(token[None, :] <= token_limit[:, None], scores, float("-inf"))
    v = tl.load(v_ptr + (loaded * DV)[:, None] + tl.arange(0, DV)[None, :])
    return _softmax_step(m, denom, acc, scores, v, PREC)


@triton.jit
def _write_step_rows(
    loc_ptr, k_ptr, v_ptr, k_out_ptr, v_out_ptr, layer, q_start, q_len, num_tokens, head,
    NUM_SLOTS: tl.constexpr, KV_HEADS: tl.constexpr, TOKENS: tl.constexpr,
    WRITE_ROWS: tl.constexpr, KEY0: tl.constexpr, KEY1: tl.constexpr, DV: tl.constexpr,
    PADDING_SLOT: tl.constexpr,
):  # fmt: skip
    """Stores the tile's tokens' K/V rows of KV head ``head`` at their pool slots; tokens
    past the tile's queries or ``num_tokens``, and padding-slot targets, are not written."""
    offset = tl.arange(0, WRITE_ROWS)
    token = q_start + offset
    keep = (offset < q_len) & (token < num_tokens)
    slot = tl.load(loc_ptr + token, mask=keep, other=PADDING_SLOT)
    keep = keep & (slot != PADDING_SLOT)
    src_row = token.to(tl.int64) * KV_HEADS + head
    pool_row = (layer.to(tl.int64) * NUM_SLOTS + slot.to(tl.int64)) * KV_HEADS + head
    _copy_rows(k_ptr + src_row * (KEY0 + KEY1), k_out_ptr + pool_row * (KEY0 + KEY1), keep, 0, KEY0)
    if KEY1 > 0:
        _copy_rows(k_ptr + src_row * (KEY0 + KEY1), k_out_ptr + pool_row * (KEY0 + KEY1), keep,
                   KEY0, KEY1)  # fmt: skip
    _copy_rows(v_ptr + src_row * DV, v_out_ptr + pool_row * DV, keep, 0, DV)


@triton.jit
def _copy_rows(src_rows, dst_rows, keep, OFFSET: tl.constexpr, WIDTH: tl.constexpr):
    """Copies columns ``[OFFSET, OFFSET + WIDTH)`` of the rows at pointers ``src_rows`` to
    ``dst_rows`` where ``keep``."""
    cols = OFFSET + tl.arange(0, WIDTH)
    rows = tl.load(src_rows[:, None] + cols[None, :], mask=keep[:, None])
    tl.store(dst_rows[:, None] + cols[None, :], rows, mask=keep[:, None])


@triton.jit
def jtbo_extend_attention_kernel(
    layer_ptr,  # [1] int32
    num_tokens_ptr,  # [1] int32
    tile_req_ptr,  # [num_tiles] int32
    tile_q_start_ptr,  # [num_tiles] int32
    tile_q_len_ptr,  # [num_tiles] int32
    tile_prefix_ptr,  # [num_tiles] int32: the tile's sequence's prefix length
    tile_new_start_ptr,  # [num_tiles] int32: flat token of the sequence's first new position
    req_to_token_ptr,  # [max_reqs, max_context] int32
    q_ptr,  # [tokens * q_heads, head_dim]
    k_pool_ptr,  # [num_layers, num_slots, kv_heads, head_dim]
    v_pool_ptr,  # [num_layers, num_slots, kv_heads, v_head_dim]
    k_ptr,  # [tokens, kv_heads, head_dim], the pool's dtype
    v_ptr,  # [tokens, kv_heads, v_head_dim], the pool's dtype
    loc_ptr,  # [tokens] int32: out_cache_loc
    o_ptr,  # [tokens * q_heads, v_head_dim] in q's dtype
    k_out_ptr,  # the K pool again (aliased output): the step's keys are written here
    v_out_ptr,  # the V pool again (aliased output)
    SCALE_LOG2: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    MAX_CONTEXT: tl.constexpr,
    TOKENS: tl.constexpr,
    QUERY_TILE: tl.constexpr,
    ZERO_PER_TILE: tl.constexpr,
    WRITE_ROWS: tl.constexpr,
    GROUP: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    KEY0: tl.constexpr,
    KEY1: tl.constexpr,
    DV: tl.constexpr,
    PADDING_SLOT: tl.constexpr,
    PREC: tl.constexpr,
):
    """``extend._extend_attention_kernel`` in Triton: one program per (KV head x row block,
    tile) attends its rows over the tile's prefix (through the page table) and the step's
    own tokens (causal) in one online softmax, stores them in place, zeros its share of the
    padded tokens' rows and, in row block 0, writes the tile's K/V rows into the pools."""
    # Grid (kv_heads * row_blocks, num_tiles), tiles from the last: a prompt's later tiles see
    # more keys, so the heavy programs start first and light ones fill the last wave.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    head = tl.program_id(0) // ROW_BLOCKS
    row_block = tl.program_id(0) % ROW_BLOCKS
    row0 = row_block * BLOCK_ROWS
    q_start = tl.load(tile_q_start_ptr + tile)
    q_len = tl.load(tile_q_len_ptr + tile)
    prefix = tl.load(tile_prefix_ptr + tile)
    new_start = tl.load(tile_new_start_ptr + tile)
    rows = row0 + tl.arange(0, BLOCK_ROWS)
    query = rows // GROUP
    row_ok = query < q_len
    q_heads = KV_HEADS * GROUP
    key_width = KEY0 + KEY1
    head_row = head * GROUP + rows % GROUP
    flat_row = (q_start + query).to(tl.int64) * q_heads + head_row
    q0, q1 = _load_query_parts(q_ptr, flat_row * key_width, row_ok, KEY0, KEY1)
    first_query = row0 // GROUP
    real = first_query < q_len
    m = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_ROWS,), tl.float32)
    acc = tl.zeros((BLOCK_ROWS, DV), tl.float32)

    # Stage 1: the prefix, through the page table. Whole blocks skip the range mask.
    prefix_end = tl.where(real, prefix, 0)
    whole_end = (prefix_end // BLOCK_KV) * BLOCK_KV
    layer = tl.load(layer_ptr)
    pool_row0 = (layer.to(tl.int64) * NUM_SLOTS) * KV_HEADS + head
    table_row = req_to_token_ptr + tl.load(tile_req_ptr + tile).to(tl.int64) * MAX_CONTEXT
    for block_start in range(0, whole_end, BLOCK_KV):
        m, denom, acc = _prefix_block(
            m, denom, acc, q0, q1, block_start, prefix_end, table_row, pool_row0, k_pool_ptr,
            v_pool_ptr, SCALE_LOG2, KV_HEADS, BLOCK_KV, KEY0, KEY1, DV, False, PREC,
        )  # fmt: skip
    for block_start in range(whole_end, prefix_end, BLOCK_KV):
        m, denom, acc = _prefix_block(
            m, denom, acc, q0, q1, block_start, prefix_end, table_row, pool_row0, k_pool_ptr,
            v_pool_ptr, SCALE_LOG2, KV_HEADS, BLOCK_KV, KEY0, KEY1, DV, True, PREC,
        )  # fmt: skip

    # Stage 2: the step's own tokens [new_start, one past the block's last query), causal.
    # Blocks up to the block's first query are seen whole by every row: no mask.
    last_query = tl.minimum(q_len, (row0 + BLOCK_ROWS - 1) // GROUP + 1)
    new_end = tl.where(real, q_start + last_query, new_start)
    whole = tl.maximum((q_start + first_query + 1 - new_start) // BLOCK_KV, 0)
    unmasked_end = tl.minimum(new_start + whole * BLOCK_KV, new_end)
    token_limit = q_start + query
    for block_start in range(new_start, unmasked_end, BLOCK_KV):
        m, denom, acc = _extend_block(
            m, denom, acc, q0, q1, block_start, token_limit, head, k_ptr, v_ptr, SCALE_LOG2,
            TOKENS, KV_HEADS, BLOCK_KV, KEY0, KEY1, DV, False, PREC,
        )  # fmt: skip
    for block_start in range(unmasked_end, new_end, BLOCK_KV):
        m, denom, acc = _extend_block(
            m, denom, acc, q0, q1, block_start, token_limit, head, k_ptr, v_ptr, SCALE_LOG2,
            TOKENS, KV_HEADS, BLOCK_KV, KEY0, KEY1, DV, True, PREC,
        )  # fmt: skip

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    _store_rows(o_ptr, flat_row, out.to(o_ptr.dtype.element_ty), row_ok, DV)

    # The padded tokens' rows: each tile's programs zero ZERO_PER_TILE tokens from
    # num_tokens + tile * ZERO_PER_TILE on (real tokens are each in one tile).
    num_tokens = tl.load(num_tokens_ptr)
    _zero_padded_rows(
        o_ptr, num_tokens, tile, query, head_row, q_heads, TOKENS, QUERY_TILE, ZERO_PER_TILE,
        BLOCK_ROWS, DV,
    )  # fmt: skip

    # The step's K/V rows of this tile and KV head into the pool (row block 0 only).
    if row_block == 0:
        _write_step_rows(
            loc_ptr, k_ptr, v_ptr, k_out_ptr, v_out_ptr, layer, q_start, q_len, num_tokens,
            head, NUM_SLOTS, KV_HEADS, TOKENS, WRITE_ROWS, KEY0, KEY1, DV, PADDING_SLOT,
        )  # fmt: skip
