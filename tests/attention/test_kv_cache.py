"""KV cache: layout, functional writes, validation."""

import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.attention import kv_cache


def test_init_layout_and_padding_slot():
    cache = kv_cache.init_kv_cache(
        num_layers=3, num_slots=10, kv_heads=2, head_dim=4, max_reqs=5, max_context=7,
        dtype=jnp.float32, v_head_dim=6,
    )  # fmt: skip
    assert cache.k.shape == (3, 10, 2, 4) and cache.v.shape == (3, 10, 2, 6)
    assert cache.req_to_token.shape == (5, 7) and cache.req_to_token.dtype == jnp.int32
    assert (cache.num_layers, cache.num_slots, cache.max_context) == (3, 10, 7)
    assert not np.asarray(cache.req_to_token).any()  # every position -> padding slot 0


def test_write_is_functional_and_touches_one_layer():
    rng = np.random.default_rng(0)
    cache = kv_cache.init_kv_cache(
        num_layers=2, num_slots=8, kv_heads=2, head_dim=3, max_reqs=2, max_context=4,
        dtype=jnp.float32,
    )  # fmt: skip
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
    with pytest.raises(ValueError, match="num_slots"):
        kv_cache.init_kv_cache(num_layers=1, num_slots=1, kv_heads=1, head_dim=1, max_reqs=1,
                               max_context=1)  # fmt: skip
    with pytest.raises(ValueError, match="kv_heads"):
        kv_cache.init_kv_cache(num_layers=1, num_slots=4, kv_heads=0, head_dim=1, max_reqs=1,
                               max_context=1)  # fmt: skip
    cache = kv_cache.init_kv_cache(num_layers=1, num_slots=4, kv_heads=2, head_dim=3,
                                   max_reqs=1, max_context=2)  # fmt: skip
    with pytest.raises(ValueError, match="k has shape"):
        kv_cache.write_kv(cache, 0, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 1, 3)),
                          jnp.zeros((2, 2, 3)))  # fmt: skip
