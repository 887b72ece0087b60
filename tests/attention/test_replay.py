"""Graph-replay children: capture-time indices over the padded buffers."""

import numpy as np

from jtbo.attention import replay
from tests.attention import scenarios


def test_verify_replay_children_fields():
    draft = 2
    sc = scenarios.make(
        np.random.default_rng(0), [4, 1, 6], [draft] * 3, token_capacity=8, custom_mask=True
    )
    padded = scenarios.verify_batch(sc, draft, padded_seqs=1)
    a, b = replay.split_replay_batch(padded)
    assert (a.batch_size, b.batch_size) == (2, 2)
    assert (a.num_valid_tokens, b.num_valid_tokens) == (4, 2)
    np.testing.assert_array_equal(b.seq_lens, [6, 0])
    np.testing.assert_array_equal(b.out_cache_loc, padded.out_cache_loc[4:])
    # Child A's mask is the first two sequences' blocks: (4+2)*2 + (1+2)*2 entries.
    np.testing.assert_array_equal(a.spec_info.custom_mask, padded.spec_info.custom_mask[:18])
    np.testing.assert_array_equal(b.spec_info.custom_mask, padded.spec_info.custom_mask[18:])


def test_decode_replay_split_uses_padded_size():
    sc = scenarios.make(np.random.default_rng(1), [3, 2, 5], [1] * 3, token_capacity=3)
    padded = scenarios.decode_batch(sc, padded_seqs=3)  # bucket of 6, 3 real
    a, b = replay.split_replay_batch(padded)
    assert (a.batch_size, b.batch_size) == (3, 3)
    assert (a.num_valid_tokens, b.num_valid_tokens) == (3, 0)
