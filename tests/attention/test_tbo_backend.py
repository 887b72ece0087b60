"""TBO attention: attention over both children (KV cache threaded A then B), merged, equals
attention over the parent batch; children metadata equals metadata built from the children."""

import dataclasses

import chex
import jax
import numpy as np
import pytest

from jtbo import split
from jtbo.attention import backend as backend_lib
from jtbo.attention import metadata, native, paged, tbo_backend
from tests.attention import scenarios

ForwardMode = split.ForwardMode
CONTEXT = 32
CONFIG = native.NativeAttentionConfig(kv_block=8)
# Small blocks and up to 2 splits so the tiny children still run a multi-block grid.
SMALL_PAGED = paged.PagedAttentionConfig(
    block_kv=16, block_rows=16, max_kv_splits=2, min_split_kv=8
)
CREATORS = {
    "native": lambda c: backend_lib.NativeAttnBackend(c, CONFIG),
    "pallas": lambda c: backend_lib.PallasAttnBackend(c, SMALL_PAGED),
    "triton": lambda c: backend_lib.TritonAttnBackend(c, SMALL_PAGED),
}
KINDS = ("native", *scenarios.KERNEL_IMPLS)  # the kernel backends by their impl's name


def _backend(capacity, child_capacity, kind="native"):
    return tbo_backend.TboAttnBackend.init_new(
        CREATORS[kind], capacity=capacity, child_capacity=child_capacity
    )


def _rows(x, start, end, capacity):
    out = np.zeros((capacity, *x.shape[1:]), x.dtype)
    out[: end - start] = x[start:end]
    return out


def _run_tbo(sc, tbo, md, ranges):
    """Parent attention, then child A and child B with the cache threaded A -> B."""
    parent_out, parent_cache = jax.jit(tbo.forward)(sc.q, sc.k, sc.v, 1, md.primary, sc.cache)
    merged = np.zeros_like(np.asarray(parent_out))
    cache = sc.cache
    for child, child_md, (start, end) in zip(tbo.children, md.children, ranges, strict=True):
        cap = child.capacity.token_capacity
        args = [_rows(x, start, end, cap) for x in (sc.q, sc.k, sc.v)]
        out, cache = jax.jit(child.forward)(*args, 1, child_md, cache)
        merged[start:end] = np.asarray(out)[: end - start]
    return np.asarray(parent_out), parent_cache, merged, cache


def _check_tbo(sc, tbo, md, ranges):
    parent_out, parent_cache, merged, cache = _run_tbo(sc, tbo, md, ranges)
    tolerance = dict(atol=scenarios.f32_tolerance(2e-5), rtol=scenarios.f32_tolerance(1e-5))
    np.testing.assert_allclose(merged, parent_out, **tolerance)
    np.testing.assert_allclose(merged.astype(np.float64), sc.expected, **tolerance)
    # Same pool contents after both micro-batches (slot 0 is the padding dump).
    np.testing.assert_array_equal(np.asarray(cache.k)[:, 1:], np.asarray(parent_cache.k)[:, 1:])
    np.testing.assert_array_equal(np.asarray(cache.v)[:, 1:], np.asarray(parent_cache.v)[:, 1:])
    return merged


def _real_ranges(children):
    """Parent rows of each child's real tokens (padding rows trail and stay out)."""
    starts = [int(c.tbo_parent_token_range[0]) for c in children]
    return [(s, s + c.num_valid_tokens) for s, c in zip(starts, children, strict=True)]


def _check_children_metadata(tbo, md, children):
    # The children-only path (the runner's, for TBO steps) builds the same metadata.
    chex.assert_trees_all_equal(tbo.init_children_metadata(children), md.children)
    for child_backend, child_md, child in zip(tbo.children, md.children, children, strict=True):
        direct = backend_lib.NativeAttnBackend(child_backend.capacity).init_forward_metadata(child)
        chex.assert_trees_all_equal(child_md, direct)


def test_two_chunk_split_child_b_reads_what_a_wrote():
    sc = scenarios.make(np.random.default_rng(0), [2, 5], [3, 20], token_capacity=24)
    parent = scenarios.extend_batch(sc)
    lens = sc.extend_lens.tolist()
    assert split.plan_extend_split(lens)[2]  # two-chunk
    seq_index = split.compute_split_seq_index(ForwardMode.EXTEND, sc.num_tokens, lens, None)
    parent = dataclasses.replace(parent, tbo_split_seq_index=seq_index)
    children = split.split_batch(parent)
    child_cap = split.child_capacity(24)
    tbo = _backend(
        metadata.extend_capacity(24, 4, CONTEXT, 4),
        metadata.extend_capacity(child_cap, 4, CONTEXT, 4),
    )
    md = tbo.init_forward_metadata(parent, children)
    _check_children_metadata(tbo, md, children)
    # Child B's first sequence starts mid-prompt: its queries sit after A's part of it.
    a_part = 11 - 3
    assert int(md.children[1].tile_q_pos[0]) == 5 + a_part
    ranges = _real_ranges(children)
    merged = _check_tbo(sc, tbo, md, ranges)

    # Poison check: if B ran against the cache *before* A's writes, B's rows would differ.
    b_start, b_end = ranges[1]
    cap = tbo.children[1].capacity.token_capacity
    args = [_rows(x, b_start, b_end, cap) for x in (sc.q, sc.k, sc.v)]
    stale, _ = jax.jit(tbo.children[1].forward)(*args, 1, md.children[1], sc.cache)
    assert not np.allclose(np.asarray(stale)[: b_end - b_start], merged[b_start:b_end], atol=1e-3)


def test_balanced_extend_split_with_padding_rows():
    sc = scenarios.make(np.random.default_rng(1), [0, 4, 1, 7], [5, 4, 6, 3], token_capacity=24)
    parent = scenarios.extend_batch(sc, rows=24)
    seq_index = split.compute_split_seq_index(ForwardMode.EXTEND, 24, sc.extend_lens.tolist(), None)
    assert seq_index == 2
    parent = dataclasses.replace(parent, tbo_split_seq_index=seq_index)
    children = split.split_batch(parent)
    child_cap = split.child_capacity(24)
    tbo = _backend(
        metadata.extend_capacity(24, 4, CONTEXT, 4),
        metadata.extend_capacity(child_cap, 4, CONTEXT, 4),
    )
    md = tbo.init_forward_metadata(parent, children)
    _check_children_metadata(tbo, md, children)
    ranges = _real_ranges(children)
    _check_tbo(sc, tbo, md, ranges)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_split_equals_parent(kind):
    # Heads of 16: the kernels' smallest tile on a GPU.
    sc = scenarios.make(
        np.random.default_rng(2), [3, 9, 0, 20, 6], [1] * 5, token_capacity=5, head_dim=16
    )
    parent = dataclasses.replace(scenarios.decode_batch(sc), tbo_split_seq_index=2)
    children = split.split_batch(parent)
    tbo = _backend(metadata.decode_capacity(5, CONTEXT), metadata.decode_capacity(3, CONTEXT), kind)
    md = tbo.init_forward_metadata(parent, children)
    _check_children_metadata(tbo, md, children)
    _check_tbo(sc, tbo, md, [(0, 2), (2, 5)])


@pytest.mark.parametrize("kind", KINDS)
def test_verify_children_from_padded_buffers(kind):
    draft = 2
    sc = scenarios.make(
        np.random.default_rng(3), [5, 0, 12], [draft] * 3, token_capacity=8, custom_mask=True,
        head_dim=16,
    )  # fmt: skip
    padded = scenarios.verify_batch(sc, draft, padded_seqs=1)  # a bucket of 4 seqs
    tbo = _backend(
        metadata.verify_capacity(4, draft, CONTEXT),
        metadata.verify_capacity(2, draft, CONTEXT),
        kind,
    )
    children = split.split_batch(dataclasses.replace(padded, tbo_split_seq_index=2))
    md = tbo.init_forward_metadata(padded, children)
    # Child B holds the third real sequence and the padded one, whose rows stay empty.
    np.testing.assert_array_equal(md.children[1].tile_q_len, [draft, 0])
    _check_tbo(sc, tbo, md, [(0, 4), (4, 8)])


def test_empty_child_gets_empty_metadata_and_structure_is_stable():
    sc = scenarios.make(np.random.default_rng(5), [3], [1], token_capacity=2)
    batch = scenarios.decode_batch(sc, padded_seqs=1)
    tbo = _backend(metadata.decode_capacity(2, CONTEXT), metadata.decode_capacity(2, CONTEXT))
    children = split.split_batch(dataclasses.replace(batch, tbo_split_seq_index=0))
    assert children[0].batch_size == 0
    md = tbo.init_forward_metadata(batch, children)
    assert int(md.children[0].num_tokens) == 0 and not md.children[0].tile_q_len.any()
    no_tbo = tbo.init_forward_metadata(batch)
    assert no_tbo.children is None
    other_children = split.split_batch(dataclasses.replace(batch, tbo_split_seq_index=1))
    other = tbo.init_forward_metadata(batch, other_children)
    assert jax.tree.structure(md) == jax.tree.structure(other)


def test_delegation_and_errors():
    primary = backend_lib.NativeAttnBackend(metadata.decode_capacity(4, CONTEXT))
    tbo = tbo_backend.TboAttnBackend(primary, [primary, primary])
    assert tbo.capacity == primary.capacity  # unknown attributes come from the primary
    with pytest.raises(ValueError, match="2 children"):
        tbo_backend.TboAttnBackend(primary, [primary])
    sc = scenarios.make(np.random.default_rng(6), [3], [1], token_capacity=4)
    with pytest.raises(ValueError, match="2 child batches"):
        tbo.init_forward_metadata(scenarios.decode_batch(sc), [scenarios.decode_batch(sc)])
    with pytest.raises(ValueError, match="2 child batches"):
        tbo.init_children_metadata([scenarios.decode_batch(sc)] * 3)
