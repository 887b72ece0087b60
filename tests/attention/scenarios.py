"""Random paged-attention scenarios with an independent float64 reference.

A scenario is a batch of sequences, each with a cached prefix and some new tokens. Every
token's K/V is drawn in float64; the prefix K/V is stored in the pool at random slots (slot 0
stays the padding slot), the page table maps positions to slots, and the new tokens' q/k/v come
in the flat token order. The reference attends per sequence directly over the drawn K/V (not
through the pool, tiles or page table), so it shares no code with the library.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.attention import kv_cache as kv_cache_lib

# float32 dots run in TF32 on NVIDIA GPUs (XLA's default precision, Triton's tl.dot): about
# 1e-3 relative there (measured up to 3.8e-3 absolute on an H200, values of order 1), float32
# rounding elsewhere.
TF32_TOLERANCE = 1e-2


KERNEL_IMPLS = ("pallas", "triton") if jax.default_backend() == "gpu" else ("pallas",)
"""The attention kernel impls to test here: the Pallas kernel (the interpreter on the CPU) and,
on GPUs, its jax-triton twin."""


def f32_tolerance(elsewhere: float) -> float:
    """A float32 comparison's tolerance: ``elsewhere`` off GPUs, ``TF32_TOLERANCE`` on them."""
    return elsewhere if jax.default_backend() == "cpu" else TF32_TOLERANCE


def assert_kernel_output(out, expected, reference, *, atol, rtol, impl: str) -> None:
    """A kernel impl's ``out`` equals the float64 ``expected`` and the native ``reference``
    within ``atol`` / ``rtol`` (the failure names ``impl``)."""
    np.testing.assert_allclose(
        np.asarray(out, np.float64), expected, atol=atol, rtol=rtol, err_msg=impl
    )
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(reference), atol=atol, rtol=rtol, err_msg=impl
    )


@dataclasses.dataclass
class Scenario:
    """One batch: per-sequence lengths, the pool, the new tokens and the reference output."""

    prefix_lens: np.ndarray  # [n]
    extend_lens: np.ndarray  # [n]
    req_pool_indices: np.ndarray  # [n]
    out_cache_loc: np.ndarray  # [num_tokens]
    cache: kv_cache_lib.KVCache
    q: np.ndarray  # [token_capacity, q_heads, d] float32
    k: np.ndarray  # [token_capacity, kv_heads, d]
    v: np.ndarray  # [token_capacity, kv_heads, d]
    expected: np.ndarray  # [token_capacity, q_heads, d] float64
    mask_rows: list | None  # per seq [extend_len, prefix + extend_len] bool (verify)
    num_tokens: int


def zero_cache(num_layers, num_slots, kv_heads, head_dim, max_reqs, max_context, v_head_dim=None):
    """A float32 all-zero cache whose page table points every position at the padding slot."""
    v_dim = head_dim if v_head_dim is None else v_head_dim
    return kv_cache_lib.KVCache(
        k=jnp.zeros((num_layers, num_slots, kv_heads, head_dim), jnp.float32),
        v=jnp.zeros((num_layers, num_slots, kv_heads, v_dim), jnp.float32),
        req_to_token=jnp.full((max_reqs, max_context), kv_cache_lib.PADDING_SLOT, jnp.int32),
    )


def make(
    rng: np.random.Generator,
    prefix_lens,
    extend_lens,
    *,
    token_capacity: int,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    max_context: int = 32,
    max_reqs: int = 8,
    num_layers: int = 2,
    layer_id: int = 1,
    custom_mask: bool = False,
    num_slots: int = 80,
) -> Scenario:
    """Draws a scenario; with ``custom_mask`` the new tokens use random EAGLE-style masks."""
    prefix_lens = np.asarray(prefix_lens, np.int64)
    extend_lens = np.asarray(extend_lens, np.int64)
    n = prefix_lens.shape[0]
    seq_lens = prefix_lens + extend_lens
    assert int(seq_lens.sum()) < num_slots, "scenario needs more pool slots"
    slots = rng.permutation(np.arange(1, num_slots))
    reqs = rng.permutation(max_reqs)[:n]
    pool_k = rng.normal(size=(num_layers, num_slots, kv_heads, head_dim)).astype(np.float32)
    pool_v = rng.normal(size=(num_layers, num_slots, kv_heads, head_dim)).astype(np.float32)
    req_to_token = np.zeros((max_reqs, max_context), np.int32)
    num_tokens = int(extend_lens.sum())
    q = rng.normal(size=(token_capacity, q_heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(token_capacity, kv_heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(token_capacity, kv_heads, head_dim)).astype(np.float32)
    expected = np.zeros((token_capacity, q_heads, head_dim))
    out_cache_loc = np.zeros((num_tokens,), np.int32)
    mask_rows = [] if custom_mask else None
    used, start = 0, 0
    group = q_heads // kv_heads
    for s in range(n):
        length, prefix, new = int(seq_lens[s]), int(prefix_lens[s]), int(extend_lens[s])
        seq_slots = slots[used : used + length]
        used += length
        req_to_token[reqs[s], :length] = seq_slots
        out_cache_loc[start : start + new] = seq_slots[prefix:]
        seq_k = np.concatenate([pool_k[layer_id, seq_slots[:prefix]], k[start : start + new]])
        seq_v = np.concatenate([pool_v[layer_id, seq_slots[:prefix]], v[start : start + new]])
        if custom_mask:
            rows = rng.random((new, length)) < 0.6
            mask_rows.append(rows)
        else:
            rows = np.arange(length)[None, :] <= (prefix + np.arange(new))[:, None]
        for i in range(new):
            for h in range(q_heads):
                qh = q[start + i, h].astype(np.float64)
                kh = seq_k[:, h // group].astype(np.float64)
                scores = kh @ qh * head_dim**-0.5
                if not rows[i].any():
                    continue
                scores = np.where(rows[i], scores, -np.inf)
                w = np.exp(scores - scores.max())
                w /= w.sum()
                expected[start + i, h] = w @ seq_v[:, h // group].astype(np.float64)
        start += new
    cache = kv_cache_lib.KVCache(
        k=jnp.asarray(pool_k), v=jnp.asarray(pool_v), req_to_token=jnp.asarray(req_to_token)
    )
    return Scenario(
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        req_pool_indices=reqs,
        out_cache_loc=out_cache_loc,
        cache=cache,
        q=q,
        k=k,
        v=v,
        expected=expected,
        mask_rows=mask_rows,
        num_tokens=num_tokens,
    )


def extend_batch(sc: Scenario, *, rows: int | None = None, mode=None):
    """The scenario as an EXTEND (or ``mode``) ``ForwardBatch`` with ``rows`` token rows."""
    from jtbo.split import batch as batch_lib
    from jtbo.split import forward_mode

    rows = sc.num_tokens if rows is None else rows
    loc = np.zeros((rows,), np.int32)
    loc[: sc.num_tokens] = sc.out_cache_loc
    return batch_lib.ForwardBatch(
        forward_mode=mode or forward_mode.ForwardMode.EXTEND,
        batch_size=sc.prefix_lens.shape[0],
        input_ids=np.arange(rows, dtype=np.int32) + 7,
        positions=np.zeros((rows,), np.int32),
        out_cache_loc=loc,
        req_pool_indices=sc.req_pool_indices,
        seq_lens=sc.prefix_lens + sc.extend_lens,
        extend_seq_lens=sc.extend_lens,
        extend_prefix_lens=sc.prefix_lens,
        num_token_non_padded=sc.num_tokens if rows != sc.num_tokens else None,
    )


def decode_batch(sc: Scenario, *, padded_seqs: int = 0):
    """The scenario (one new token per sequence) as a DECODE batch, plus padded sequences."""
    from jtbo.split import batch as batch_lib
    from jtbo.split import forward_mode

    pad = np.zeros((padded_seqs,), np.int64)
    bs = sc.prefix_lens.shape[0] + padded_seqs
    return batch_lib.ForwardBatch(
        forward_mode=forward_mode.ForwardMode.DECODE,
        batch_size=bs,
        input_ids=np.arange(bs, dtype=np.int32),
        out_cache_loc=np.concatenate([sc.out_cache_loc, pad]),
        req_pool_indices=np.concatenate([sc.req_pool_indices, pad]),
        seq_lens=np.concatenate([sc.prefix_lens + 1, pad]),
        num_token_non_padded=sc.num_tokens,
    )


def verify_batch(sc: Scenario, draft: int, *, padded_seqs: int = 0):
    """The scenario (``draft`` tokens per sequence, random masks) as a TARGET_VERIFY batch."""
    from jtbo.split import batch as batch_lib
    from jtbo.split import forward_mode

    prefix = np.concatenate([sc.prefix_lens, np.zeros((padded_seqs,), np.int64)])
    masks = [rows.reshape(-1) for rows in sc.mask_rows]
    masks += [np.zeros((draft * draft,), bool)] * padded_seqs
    bs = prefix.shape[0]
    loc = np.zeros((bs * draft,), np.int32)
    loc[: sc.num_tokens] = sc.out_cache_loc
    spec = batch_lib.SpecVerifyInput(
        draft_token=np.zeros((bs * draft,), np.int32),
        custom_mask=np.concatenate(masks),
        seq_lens=prefix,
        draft_token_num=draft,
    )
    return batch_lib.ForwardBatch(
        forward_mode=forward_mode.ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=np.zeros((bs * draft,), np.int32),
        out_cache_loc=loc,
        req_pool_indices=np.concatenate([sc.req_pool_indices, np.zeros((padded_seqs,), np.int64)]),
        seq_lens=prefix,
        spec_info=spec,
        num_token_non_padded=sc.num_tokens,
    )
