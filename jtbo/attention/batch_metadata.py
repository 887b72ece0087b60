"""Host translation of a ``ForwardBatch`` into attention metadata, per forward mode.

Each mode says, per sequence, which query rows it owns and which KV positions they see
(SGLang's semantics, as in its torch-native and triton backends):

* EXTEND / MIXED / DRAFT_EXTEND: rows ``extend_start_loc .. + extend_seq_lens`` at positions
  ``extend_prefix_lens ..``; KV ``[0, seq_lens)`` (prefix + new tokens, causal). A two-chunk
  TBO child needs nothing special: its derived ``seq_lens`` / ``extend_prefix_lens`` already
  say that child B's first sequence continues a prefix that child A wrote.
* DECODE: row ``i`` at position ``seq_lens[i] - 1``; KV ``[0, seq_lens)`` (``seq_lens`` counts
  the new token). Padded sequences (``seq_lens == 0``) get no rows.
* TARGET_VERIFY: rows ``i * draft .. + draft``; ``seq_lens`` is the committed prefix (as in
  SGLang), the draft tokens sit at KV positions ``seq_lens ..``; KV ``[0, seq_lens + draft)``
  filtered by the flat EAGLE custom mask (sequence ``i`` owns ``draft`` rows of
  ``seq_lens[i] + draft`` entries at ``custom_mask_offsets``).
* IDLE / PREBUILT / no sequences: empty metadata.

Rows at or past ``num_valid_tokens`` never get a tile, so they come out as zeros.
"""

import numpy as np

from jtbo.attention import metadata as metadata_lib
from jtbo.attention import tiling
from jtbo.split import batch as batch_lib
from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode


def _require(batch, *names: str) -> list[np.ndarray]:
    """Returns the named fields as int64 arrays; ValueError when one is missing."""
    missing = [name for name in names if getattr(batch, name) is None]
    if missing:
        raise ValueError(f"{batch.forward_mode.name} attention needs ForwardBatch.{missing}")
    return [np.asarray(getattr(batch, name), np.int64) for name in names]


def _extend_rows(batch) -> dict:
    req, start, new, prefix = _require(
        batch, "req_pool_indices", "extend_start_loc", "extend_seq_lens", "extend_prefix_lens"
    )
    kv_len = prefix + new if batch.seq_lens is None else np.asarray(batch.seq_lens, np.int64)
    return dict(req=req, q_start=start, q_len=new, q_pos=prefix, kv_len=kv_len)


def _decode_rows(batch) -> dict:
    req, seq_lens = _require(batch, "req_pool_indices", "seq_lens")
    rows = np.arange(batch.batch_size)
    q_len = ((seq_lens > 0) & (rows < batch.num_valid_tokens)).astype(np.int64)
    return dict(
        req=req, q_start=rows, q_len=q_len, q_pos=np.maximum(seq_lens - 1, 0), kv_len=seq_lens
    )


def _verify_rows(batch) -> dict:
    req, seq_lens = _require(batch, "req_pool_indices", "seq_lens")
    spec = batch.spec_info
    if spec is None or spec.custom_mask is None:
        raise ValueError("TARGET_VERIFY attention needs spec_info.custom_mask")
    if spec.seq_lens is not None and not np.array_equal(np.asarray(spec.seq_lens), seq_lens):
        raise ValueError(
            f"spec_info.seq_lens {np.asarray(spec.seq_lens).tolist()} != ForwardBatch.seq_lens "
            f"{seq_lens.tolist()} (both are the committed prefix lengths)"
        )
    draft = spec.draft_token_num
    q_start = np.arange(batch.batch_size) * draft
    q_len = np.clip(batch.num_valid_tokens - q_start, 0, draft)
    offsets = batch_lib.custom_mask_offsets(seq_lens, draft)
    flat = np.asarray(spec.custom_mask, bool)
    mask_rows = [
        flat[offsets[i] : offsets[i + 1]].reshape(draft, seq_lens[i] + draft)[: q_len[i]]
        for i in range(batch.batch_size)
    ]
    rows = dict(req=req, q_start=q_start, q_len=q_len, q_pos=seq_lens, kv_len=seq_lens + draft)
    return dict(rows, mask_rows=mask_rows)


def _check_capacity(batch, capacity: metadata_lib.AttentionCapacity) -> None:
    """The capacity's masking rule and tile size must fit the mode; ValueError otherwise."""
    verify = batch.forward_mode.is_target_verify()
    if verify != capacity.custom_mask:
        raise ValueError(
            f"{batch.forward_mode.name} batch needs custom_mask={verify}, capacity has "
            f"{capacity.custom_mask}"
        )
    if verify and capacity.query_tile != batch.spec_info.draft_token_num:
        raise ValueError(
            f"TARGET_VERIFY needs query_tile == draft_token_num = "
            f"{batch.spec_info.draft_token_num}, capacity has {capacity.query_tile}"
        )
    # Trailing padding rows (e.g. a TBO child B inheriting the parent's) need no room.
    if batch.num_valid_tokens > capacity.token_capacity:
        raise ValueError(
            f"batch has {batch.num_valid_tokens} real tokens, token_capacity is "
            f"{capacity.token_capacity}"
        )


def forward_batch_metadata(
    batch: batch_lib.ForwardBatch, capacity: metadata_lib.AttentionCapacity
) -> metadata_lib.AttentionMetadata:
    """Builds the attention metadata of one DP rank's host batch.

    Args:
      batch: the step (host arrays), possibly a TBO child.
      capacity: static sizes (one compile per value).

    Returns:
      Numpy-backed ``AttentionMetadata``.

    Raises:
      ValueError: an unsupported mode, a missing field, or a batch that does not fit.
    """
    mode = batch.forward_mode
    if mode.is_idle() or mode.is_prebuilt() or batch.batch_size == 0:
        return metadata_lib.empty_metadata(capacity)
    _check_capacity(batch, capacity)
    if mode in batch_lib.RAGGED_EXTEND_MODES:
        rows = _extend_rows(batch)
    elif mode.is_decode():
        rows = _decode_rows(batch)
    elif mode.is_target_verify():
        rows = _verify_rows(batch)
    else:
        raise ValueError(f"attention has no metadata for forward_mode {mode.name}")
    if batch.out_cache_loc is None:
        raise ValueError(f"{mode.name} attention needs ForwardBatch.out_cache_loc")
    return tiling.build_metadata(
        capacity, out_cache_loc=batch.out_cache_loc, num_tokens=batch.num_valid_tokens, **rows
    )
