"""Float64 numpy references of MLA over an explicit context, in both forms.

They take the context's latent rows directly (no pool, page table, tiles or blocks), so they
share no code with ``jtbo.attention.mla``. ``decompressed`` builds every head's keys and
values from the latent and runs a plain masked softmax; ``absorbed`` folds the up-projection
into the query and the output. In float64 the two agree to about 1e-15, which makes each a
check of the other's algebra and both an oracle for the float32 kernel.
"""

import numpy as np


def _softmax_rows(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Masked softmax over the last axis; rows with no visible key give zeros."""
    scores = np.where(mask, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores - np.where(np.isfinite(row_max), row_max, 0.0))
    total = probs.sum(axis=-1, keepdims=True)
    return probs / np.where(total > 0, total, 1.0)


def decompressed(q_nope, q_pe, latent, w_kv_b, mask, scaling: float) -> np.ndarray:
    """MLA with per-head keys and values up-projected from the latent.

    Args:
      q_nope: ``[L, heads, nope]``; q_pe: ``[L, heads, rope]`` (RoPE applied).
      latent: ``[S, rank + rope]`` context rows ``[c, k_pe]`` (RoPE applied to ``k_pe``).
      w_kv_b: ``[rank, heads, nope + v]``.
      mask: ``[L, S]`` bool, True where query ``l`` sees context row ``s``.
      scaling: softmax scale.

    Returns:
      ``[L, heads, v]`` float64.
    """
    q_nope, q_pe, latent, w = (np.asarray(x, np.float64) for x in (q_nope, q_pe, latent, w_kv_b))
    rank, nope = w.shape[0], q_nope.shape[-1]
    c, k_pe = latent[:, :rank], latent[:, rank:]
    k_nope = np.einsum("sr,rhn->shn", c, w[..., :nope])
    values = np.einsum("sr,rhv->shv", c, w[..., nope:])
    scores = np.einsum("lhn,shn->hls", q_nope, k_nope) + np.einsum("lhp,sp->hls", q_pe, k_pe)
    probs = _softmax_rows(scores * scaling, np.asarray(mask)[None])
    return np.einsum("hls,shv->lhv", probs, values)


def absorbed(q_nope, q_pe, latent, w_kv_b, mask, scaling: float) -> np.ndarray:
    """MLA with ``W_UK`` folded into the query and ``W_UV`` applied after the softmax.

    Args and returns as ``decompressed``.
    """
    q_nope, q_pe, latent, w = (np.asarray(x, np.float64) for x in (q_nope, q_pe, latent, w_kv_b))
    rank, nope = w.shape[0], q_nope.shape[-1]
    q_latent = np.einsum("lhn,rhn->lhr", q_nope, w[..., :nope])
    q = np.concatenate([q_latent, q_pe], axis=-1)  # [L, heads, rank + rope]
    scores = np.einsum("lhd,sd->hls", q, latent)
    probs = _softmax_rows(scores * scaling, np.asarray(mask)[None])
    out_latent = np.einsum("hls,sr->lhr", probs, latent[:, :rank])
    return np.einsum("lhr,rhv->lhv", out_latent, w[..., nope:])
