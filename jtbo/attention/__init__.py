"""jtbo.attention: paged KV cache, native attention, the extend and paged kernels
(extend/decode/verify) in Pallas and in Triton (jax-triton), TBO backend."""

from jtbo.attention.backend import NativeAttnBackend, PallasAttnBackend, TritonAttnBackend
from jtbo.attention.batch_metadata import forward_batch_metadata
from jtbo.attention.extend import ExtendAttentionConfig, extend_attention
from jtbo.attention.kv_cache import PADDING_SLOT, KVCache, write_kv
from jtbo.attention.metadata import (
    AttentionCapacity,
    AttentionMetadata,
    decode_capacity,
    empty_metadata,
    extend_capacity,
    verify_capacity,
)
from jtbo.attention.native import NativeAttentionConfig, attend, forward
from jtbo.attention.paged import PagedAttentionConfig, paged_attention
from jtbo.attention.tbo_backend import TboAttnBackend, TboAttnMetadata
from jtbo.attention.tiling import build_metadata

__all__ = [
    "PADDING_SLOT",
    "AttentionCapacity",
    "AttentionMetadata",
    "ExtendAttentionConfig",
    "KVCache",
    "NativeAttentionConfig",
    "NativeAttnBackend",
    "PagedAttentionConfig",
    "PallasAttnBackend",
    "TboAttnBackend",
    "TboAttnMetadata",
    "TritonAttnBackend",
    "attend",
    "build_metadata",
    "decode_capacity",
    "empty_metadata",
    "extend_attention",
    "extend_capacity",
    "forward",
    "forward_batch_metadata",
    "paged_attention",
    "verify_capacity",
    "write_kv",
]
