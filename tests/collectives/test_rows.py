"""Row helpers: rank_within_group against a numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.collectives import rows


def _rank_reference(group: np.ndarray, num_groups: int) -> np.ndarray:
    seen = {}
    out = np.zeros(len(group), np.int32)
    for i, g in enumerate(group.tolist()):
        if 0 <= g < num_groups:
            out[i] = seen.get(g, 0)
            seen[g] = out[i] + 1
    return out


@settings(max_examples=30, deadline=None)
@given(data=st.data(), num_groups=st.integers(1, 9))
def test_rank_within_group_matches_numpy(data, num_groups):
    values = data.draw(st.lists(st.integers(-1, num_groups), min_size=1, max_size=40))
    group = np.asarray(values, np.int32)
    got = rows.rank_within_group(jnp.asarray(group), num_groups)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), _rank_reference(group, num_groups))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32])
def test_rank_within_group_example(dtype):
    group = jnp.asarray([2, 0, 2, 3, 2, 0], dtype)  # 3 == num_groups: no group
    got = rows.rank_within_group(group, 3)
    np.testing.assert_array_equal(np.asarray(got), [0, 0, 1, 0, 2, 1])
