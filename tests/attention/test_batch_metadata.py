"""ForwardBatch -> metadata for each mode, checked through the attention it drives."""

import jax
import numpy as np
import pytest

from jtbo.attention import batch_metadata, metadata, native
from jtbo.split import batch as batch_lib
from jtbo.split import forward_mode
from tests.attention import scenarios

ForwardMode = forward_mode.ForwardMode
CONTEXT = 32
CONFIG = native.NativeAttentionConfig(kv_block=8)
_forward = jax.jit(native.forward, static_argnames=("scaling", "config"))


def _run(sc, md):
    out, _ = _forward(sc.q, sc.k, sc.v, 1, md, sc.cache, config=CONFIG)
    np.testing.assert_allclose(np.asarray(out, np.float64), sc.expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
def test_extend_with_padded_rows(mode):
    # MIXED: a decode-like sequence (one new token after a prefix) among prefill ones.
    sc = scenarios.make(np.random.default_rng(1), [3, 0, 12], [5, 6, 1], token_capacity=16)
    batch = scenarios.extend_batch(sc, rows=14, mode=mode)
    md = batch_metadata.forward_batch_metadata(batch, metadata.extend_capacity(16, 4, CONTEXT, 4))
    np.testing.assert_array_equal(md.tile_q_pos[:5], [3, 7, 0, 4, 12])
    np.testing.assert_array_equal(md.tile_q_len[:6], [4, 1, 4, 2, 1, 0])
    assert int(md.num_tokens) == 12
    _run(sc, md)


def test_decode_with_padded_sequences():
    sc = scenarios.make(np.random.default_rng(2), [4, 17, 0], [1, 1, 1], token_capacity=5)
    batch = scenarios.decode_batch(sc, padded_seqs=2)
    md = batch_metadata.forward_batch_metadata(batch, metadata.decode_capacity(5, CONTEXT))
    np.testing.assert_array_equal(md.tile_q_len, [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(md.tile_kv_len[:3], [5, 18, 1])
    _run(sc, md)


def test_target_verify_with_padded_sequence():
    draft = 2
    sc = scenarios.make(
        np.random.default_rng(3), [6, 0, 9], [draft] * 3, token_capacity=8, custom_mask=True
    )
    batch = scenarios.verify_batch(sc, draft, padded_seqs=1)
    md = batch_metadata.forward_batch_metadata(batch, metadata.verify_capacity(4, draft, CONTEXT))
    np.testing.assert_array_equal(md.tile_kv_len[:3], [8, 2, 11])
    _run(sc, md)


def test_idle_and_empty_batches_give_empty_metadata():
    capacity = metadata.decode_capacity(4, CONTEXT)
    idle = batch_lib.ForwardBatch(
        forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=np.zeros((0,), np.int32)
    )
    md = batch_metadata.forward_batch_metadata(idle, capacity)
    assert not md.tile_q_len.any() and int(md.num_tokens) == 0
    sc = scenarios.make(np.random.default_rng(4), [3], [1], token_capacity=4)
    out, _ = _forward(sc.q, sc.k, sc.v, 1, md, sc.cache, config=CONFIG)
    assert not np.asarray(out).any()


def test_metadata_of_ranks_stacks():
    capacity = metadata.extend_capacity(16, 4, CONTEXT, 4)
    mds = [
        batch_metadata.forward_batch_metadata(
            scenarios.extend_batch(
                scenarios.make(np.random.default_rng(s), p, n, token_capacity=16)
            ),
            capacity,
        )
        for s, (p, n) in enumerate([([1], [9]), ([0, 2, 5], [1, 1, 4])])
    ]
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *mds)
    assert stacked.tile_req.shape == (2, capacity.num_tiles)
    assert stacked.capacity == capacity


def test_capacity_mismatches_are_value_errors():
    sc = scenarios.make(np.random.default_rng(5), [2, 2], [9, 9], token_capacity=18)
    batch = scenarios.extend_batch(sc)
    with pytest.raises(ValueError, match="token_capacity"):
        batch_metadata.forward_batch_metadata(batch, metadata.extend_capacity(16, 4, CONTEXT))
    with pytest.raises(ValueError, match="custom_mask"):
        batch_metadata.forward_batch_metadata(batch, metadata.verify_capacity(4, 2, CONTEXT))
    with pytest.raises(ValueError, match="sequences"):
        batch_metadata.forward_batch_metadata(batch, metadata.extend_capacity(18, 1, CONTEXT))
    with pytest.raises(ValueError, match="max_context"):
        batch_metadata.forward_batch_metadata(batch, metadata.extend_capacity(18, 4, 8))


def test_verify_needs_query_tile_equal_to_draft_token_num():
    draft = 2
    sc = scenarios.make(
        np.random.default_rng(6), [3, 4], [draft] * 2, token_capacity=4, custom_mask=True
    )
    batch = scenarios.verify_batch(sc, draft)
    with pytest.raises(ValueError, match="query_tile"):
        batch_metadata.forward_batch_metadata(batch, metadata.verify_capacity(2, 3, CONTEXT))
