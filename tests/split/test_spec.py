"""split_spec_info: per-sequence custom-mask offsets and token / sequence slicing."""

import dataclasses

import numpy as np
import pytest

from jtbo.split import batch as batch_lib
from jtbo.split import spec
from tests.split import batches


def test_mask_offsets_match_block_sizes():
    offsets = batch_lib.custom_mask_offsets(np.array([3, 1, 4]), 2)
    np.testing.assert_array_equal(offsets, [0, 10, 16, 28])


@pytest.mark.parametrize("seq_range", [(0, 3), (1, 3), (1, 2), (2, 2), (0, 0)])
def test_slices_every_field(seq_range):
    s0, s1 = seq_range
    info = batches.spec_input([3, 1, 4], 2, seed=3)
    out = spec.split_spec_info(
        info, start_seq_index=s0, end_seq_index=s1, start_token_index=2 * s0, end_token_index=2 * s1
    )
    sizes = [(n + 2) * 2 for n in (3, 1, 4)]
    lo, hi = sum(sizes[:s0]), sum(sizes[:s1])
    np.testing.assert_array_equal(out.custom_mask, info.custom_mask[lo:hi])
    np.testing.assert_array_equal(out.draft_token, info.draft_token[2 * s0 : 2 * s1])
    np.testing.assert_array_equal(out.retrieve_next_sibling, info.retrieve_next_sibling[s0:s1])
    np.testing.assert_array_equal(out.retrieve_cum_len, info.retrieve_cum_len[s0:s1])
    assert out.draft_token_num == 2
    out.validate(num_tokens=2 * (s1 - s0), batch_size=s1 - s0)


def test_none_and_missing_seq_lens():
    kw = dict(start_seq_index=0, end_seq_index=1, start_token_index=0, end_token_index=2)
    assert spec.split_spec_info(None, **kw) is None
    info = dataclasses.replace(batches.spec_input([3], 2), seq_lens=None)
    with pytest.raises(ValueError, match="seq_lens"):
        spec.split_spec_info(info, **kw)
