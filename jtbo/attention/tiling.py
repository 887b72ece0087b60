"""Host construction of attention metadata: cut each sequence's queries into tiles.

Input is one row per sequence (numpy, host side): the page-table row, where its queries start
in the flat token array and how many there are, the KV position of its first query, how many
KV positions it exposes, and for TARGET_VERIFY its rows of the custom mask. Output is the
``AttentionMetadata`` pytree (numpy arrays at the static capacity). Everything is checked here,
once, on small integers, so the device kernel can trust the metadata.
"""

import numpy as np

from jtbo.attention import metadata as metadata_lib
from jtbo.core import arith


def _check_le(name: str, values: np.ndarray, limit: int, what: str) -> None:
    """Raises ValueError naming ``name`` when some of ``values`` exceed ``limit``."""
    if values.size and values.max() > limit:
        bad = int(np.argmax(values > limit))
        raise ValueError(f"{name}[{bad}] = {values[bad]} exceeds {what} = {limit}")


def _validate(capacity, req, q_start, q_len, q_pos, kv_len, num_tokens) -> None:
    """Checks the per-sequence description against the capacity and against itself."""
    n = req.shape[0]
    if n > capacity.seq_capacity:
        raise ValueError(f"batch has {n} sequences, seq_capacity is {capacity.seq_capacity}")
    if not 0 <= num_tokens <= capacity.token_capacity:
        raise ValueError(f"num_tokens = {num_tokens} outside [0, {capacity.token_capacity}]")
    for name, values in (("req", req), ("q_start", q_start), ("q_len", q_len), ("q_pos", q_pos)):
        if values.size and values.min() < 0:
            raise ValueError(f"{name} has a negative entry: {values.tolist()}")
    # Sequences without queries (padding) may point anywhere; only real rows must fit.
    _check_le("q_start + q_len", np.where(q_len > 0, q_start + q_len, 0), num_tokens, "num_tokens")
    _check_le("kv_len", kv_len, capacity.max_context, "max_context")
    _check_covered(q_start, q_len, num_tokens)
    over = (q_pos + q_len > kv_len) & (q_len > 0)
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(
            f"sequence {i}: queries reach KV position {q_pos[i] + q_len[i]} but kv_len is "
            f"{kv_len[i]} (seq_lens must count the step's new tokens)"
        )


def _check_covered(q_start: np.ndarray, q_len: np.ndarray, num_tokens: int) -> None:
    """The sequences' query tokens must be ``[0, num_tokens)``, each token in one sequence.

    The attention kernels write each output row once: a real token no tile covers would be
    left unwritten, and one that two sequences claim written twice.
    """
    real = q_len > 0
    order = np.argsort(q_start[real], kind="stable")
    starts, ends = q_start[real][order], (q_start + q_len)[real][order]
    bounds = np.concatenate([[0], ends])
    gaps = np.flatnonzero(np.concatenate([starts, [num_tokens]]) != bounds)
    if gaps.size:
        at = int(gaps[0])
        raise ValueError(
            f"sequences' query tokens must cover [0, num_tokens = {num_tokens}) once, in "
            f"runs that meet: after token {int(bounds[at])} the next run starts at "
            f"{int(np.concatenate([starts, [num_tokens]])[at])}"
        )


def _tile_rows(q_len: np.ndarray, query_tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns (sequence of each tile, query offset of each tile inside its sequence)."""
    tiles_per_seq = arith.ceil_div(q_len, query_tile)
    tile_seq = np.repeat(np.arange(q_len.shape[0]), tiles_per_seq)
    first_tile = np.cumsum(tiles_per_seq) - tiles_per_seq
    tile_offset = (np.arange(tile_seq.shape[0]) - first_tile[tile_seq]) * query_tile
    return tile_seq, tile_offset


def _pad(values: np.ndarray, size: int) -> np.ndarray:
    """Returns ``values`` as int32, zero-padded to ``size`` entries."""
    out = np.zeros((size,), np.int32)
    out[: values.shape[0]] = values
    return out


def build_metadata(
    capacity: metadata_lib.AttentionCapacity,
    *,
    req: np.ndarray,
    q_start: np.ndarray,
    q_len: np.ndarray,
    q_pos: np.ndarray,
    kv_len: np.ndarray,
    out_cache_loc: np.ndarray,
    num_tokens: int,
    mask_rows: list[np.ndarray] | None = None,
) -> metadata_lib.AttentionMetadata:
    """Builds tiles from one row per sequence.

    Args:
      capacity: static sizes of the result.
      req: page-table row of each sequence, ``[n]``.
      q_start: flat index of each sequence's first query token, ``[n]``.
      q_len: query tokens of each sequence, ``[n]`` (0 allowed: no tile).
      q_pos: KV position of each sequence's first query, ``[n]``.
      kv_len: KV positions each sequence exposes, ``[n]``.
      out_cache_loc: pool slot of each real token, ``[>= num_tokens]``; entries past
        ``num_tokens`` are ignored (padding writes to slot 0).
      num_tokens: real query tokens of the step.
      mask_rows: with ``capacity.custom_mask``, per sequence a bool ``[q_len, kv_len]`` array.

    Returns:
      Numpy-backed ``AttentionMetadata``.

    Raises:
      ValueError: the batch does not fit the capacity or is inconsistent.
    """
    req, q_start, q_len, q_pos, kv_len = (
        np.asarray(x, np.int64).reshape(-1) for x in (req, q_start, q_len, q_pos, kv_len)
    )
    _validate(capacity, req, q_start, q_len, q_pos, kv_len, num_tokens)
    tile_seq, tile_offset = _tile_rows(q_len, capacity.query_tile)
    if tile_seq.shape[0] > capacity.num_tiles:
        raise ValueError(
            f"batch needs {tile_seq.shape[0]} query tiles of {capacity.query_tile}, "
            f"num_tiles is {capacity.num_tiles}"
        )
    loc = np.zeros((capacity.token_capacity,), np.int32)
    loc[:num_tokens] = np.asarray(out_cache_loc).reshape(-1)[:num_tokens]
    size = capacity.num_tiles
    return metadata_lib.AttentionMetadata(
        tile_req=_pad(req[tile_seq], size),
        tile_q_start=_pad(q_start[tile_seq] + tile_offset, size),
        tile_q_len=_pad(np.minimum(q_len[tile_seq] - tile_offset, capacity.query_tile), size),
        tile_q_pos=_pad(q_pos[tile_seq] + tile_offset, size),
        tile_kv_len=_pad(kv_len[tile_seq], size),
        out_cache_loc=loc,
        num_tokens=np.asarray(num_tokens, np.int32),
        custom_mask=_tile_mask(capacity, mask_rows, q_len, kv_len, tile_seq, tile_offset),
        capacity=capacity,
    )


def _tile_mask(capacity, mask_rows, q_len, kv_len, tile_seq, tile_offset) -> np.ndarray | None:
    """Lays the per-sequence mask rows out per tile: ``[num_tiles, query_tile, max_context]``."""
    if not capacity.custom_mask:
        if mask_rows is not None:
            raise ValueError("mask_rows given but capacity.custom_mask is False")
        return None
    if mask_rows is None or len(mask_rows) != q_len.shape[0]:
        got = None if mask_rows is None else len(mask_rows)
        raise ValueError(
            f"custom_mask capacity needs mask_rows for {q_len.shape[0]} seqs, got {got}"
        )
    tile = capacity.query_tile
    out = np.zeros((capacity.num_tiles, tile, capacity.max_context), bool)
    for t, (s, off) in enumerate(zip(tile_seq, tile_offset, strict=True)):
        rows = np.asarray(mask_rows[s], bool)
        if rows.shape != (q_len[s], kv_len[s]):
            raise ValueError(
                f"mask_rows[{s}] has shape {rows.shape}, expected {(int(q_len[s]), int(kv_len[s]))}"
            )
        block = rows[off : off + tile]
        out[t, : block.shape[0], : block.shape[1]] = block
    return out
