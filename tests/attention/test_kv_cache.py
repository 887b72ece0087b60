"""KV cache: layout, functional writes, validation."""

import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.attention import kv_cache
from tests.attention.scenarios import zero_cache


def test_layout_properties():
    cache = zero_cache(3, 10, 2, 4, 5, 7, v_head_dim=6)
    assert (cache.num_layers, cache.num_slots, cache.max_context) == (3, 10, 7)


def test_write_is_functional_and_touches_one_layer():
    rng = np.random.default_rng(0)
    cache = zero_cache(2, 8, 2, 3, 2, 4)
    k, v = rng.normal(size=(2, 3, 2, 3)).astype(np.float32)
    loc = np.array([5, 2, 0], np.int32)
    new = kv_cache.write_kv(cache, 1, jnp.asarray(loc), k, v)
    np.testing.assert_array_equal(np.asarray(new.k[1, [5, 2]]), k[:2])
    np.testing.assert_array_equal(np.asarray(new.v[1, [5, 2]]), v[:2])
    assert not np.asarray(new.k[0]).any()  # other layer untouched
    assert not np.asarray(cache.k).any()  # input cache unchanged
    untouched = [s for s in range(8) if s not in (5, 2, 0)]
    assert not np.asarray(new.k[1, untouched]).any()


def test_validation():
    cache = zero_cache(1, 4, 2, 3, 1, 2)
    with pytest.raises(ValueError, match="k has shape"):
        kv_cache.write_kv(cache, 0, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 1, 3)),
                          jnp.zeros((2, 2, 3)))  # fmt: skip
    with pytest.raises(ValueError, match="v has shape"):
        kv_cache.write_kv(cache, 0, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2, 3)),
                          jnp.zeros((2, 2, 4)))  # fmt: skip
