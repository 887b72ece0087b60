"""Random host batches for the split tests (positions consistent with prefixes)."""

import numpy as np

from jtbo.split import batch as batch_lib
from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode


def extend_positions(extend_lens, prefix_lens) -> np.ndarray:
    """Each sequence's new tokens sit at positions prefix .. prefix + len - 1."""
    parts = [p + np.arange(n) for n, p in zip(extend_lens, prefix_lens, strict=True)]
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def extend_batch(extend_lens, prefix_lens=None, *, seed=0, mode=ForwardMode.EXTEND, **kw):
    """An EXTEND/MIXED batch with random ids/slots and consistent lengths and positions."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(extend_lens, np.int32)
    prefix = rng.integers(0, 50, lens.shape[0]) if prefix_lens is None else prefix_lens
    prefix = np.asarray(prefix, np.int32)
    n = int(lens.sum())
    return batch_lib.ForwardBatch(
        forward_mode=mode,
        batch_size=lens.shape[0],
        input_ids=rng.integers(1, 32000, n).astype(np.int32),
        positions=extend_positions(lens, prefix),
        out_cache_loc=rng.integers(1, 10_000, n).astype(np.int32),
        req_pool_indices=rng.permutation(lens.shape[0] + 3)[: lens.shape[0]].astype(np.int32),
        seq_lens=prefix + lens,
        extend_seq_lens=lens,
        extend_prefix_lens=prefix,
        **kw,
    )


def decode_batch(batch_size, *, seed=0, **kw):
    """A DECODE batch: one token per sequence at position seq_len - 1."""
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(1, 100, batch_size).astype(np.int32)
    return batch_lib.ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=batch_size,
        input_ids=rng.integers(1, 32000, batch_size).astype(np.int32),
        positions=seq_lens - 1,
        out_cache_loc=rng.integers(1, 10_000, batch_size).astype(np.int32),
        req_pool_indices=np.arange(batch_size, dtype=np.int32),
        seq_lens=seq_lens,
        **kw,
    )


def spec_input(seq_lens, draft_token_num, *, seed=0) -> batch_lib.SpecVerifyInput:
    """An EAGLE verify input with a random mask of the right per-sequence sizes."""
    rng = np.random.default_rng(seed)
    seq_lens = np.asarray(seq_lens, np.int32)
    bs, n = seq_lens.shape[0], seq_lens.shape[0] * draft_token_num
    mask_len = int(((seq_lens + draft_token_num) * draft_token_num).sum())
    table = (bs, draft_token_num)
    return batch_lib.SpecVerifyInput(
        draft_token=rng.integers(1, 32000, n).astype(np.int32),
        positions=np.repeat(seq_lens, draft_token_num) + np.tile(np.arange(draft_token_num), bs),
        custom_mask=rng.random(mask_len) < 0.5,
        retrieve_index=rng.integers(0, n + 1, table).astype(np.int32),
        retrieve_next_token=rng.integers(-1, draft_token_num, table).astype(np.int32),
        retrieve_next_sibling=rng.integers(-1, draft_token_num, table).astype(np.int32),
        retrieve_cum_len=np.arange(bs, dtype=np.int32) * draft_token_num,
        seq_lens=seq_lens,
        draft_token_num=draft_token_num,
    )


def verify_batch(seq_lens, draft_token_num, *, seed=0, **kw):
    """A TARGET_VERIFY batch carrying ``spec_input``."""
    spec = spec_input(seq_lens, draft_token_num, seed=seed)
    bs = len(seq_lens)
    return batch_lib.ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=spec.draft_token.copy(),
        positions=spec.positions.copy(),
        out_cache_loc=np.arange(bs * draft_token_num, dtype=np.int32) + 7,
        req_pool_indices=np.arange(bs, dtype=np.int32),
        seq_lens=np.asarray(seq_lens, np.int32),  # SGLang: committed lengths, no drafts
        spec_info=spec,
        **kw,
    )
