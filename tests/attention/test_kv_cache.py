"""KV cache: layout, functional writes, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo import aot
from jtbo.attention import kv_cache
from tests.attention.scenarios import zero_cache


def test_layout_properties():
    cache = zero_cache(3, 10, 2, 4, 5, 7, v_head_dim=6)
    assert (cache.num_layers, cache.num_slots, cache.max_context) == (3, 10, 7)


def test_write_is_functional_and_touches_one_layer():
    rng = np.random.default_rng(0)
    cache = zero_cache(2, 8, 2, 3, 2, 4)
    k, v = rng.normal(size=(2, 4, 2, 3)).astype(np.float32)
    loc = np.array([5, 2, 0, 0], np.int32)  # two padded tokens
    new = kv_cache.write_kv(cache, 1, jnp.asarray(loc), k, v)
    np.testing.assert_array_equal(np.asarray(new.k[1, [5, 2]]), k[:2])
    np.testing.assert_array_equal(np.asarray(new.v[1, [5, 2]]), v[:2])
    assert not np.asarray(new.k[0]).any()  # other layer untouched
    assert not np.asarray(cache.k).any()  # input cache unchanged
    untouched = [s for s in range(8) if s not in (5, 2)]
    assert not np.asarray(new.k[1, untouched]).any()  # the padded tokens' writes are dropped
    assert not np.asarray(new.v[1, untouched]).any()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compiles for an H200 on the CPU")
def test_the_compiled_write_is_a_scatter_with_unique_indices():
    # XLA:GPU scatters without atomics only when the indices are known to be distinct.
    mesh = aot.gpu_mesh((1,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    pool = spec((2, 1025, 8, 128), jnp.bfloat16)
    cache = kv_cache.KVCache(k=pool, v=pool, req_to_token=spec((4, 256), jnp.int32))
    rows = spec((512, 8, 128), jnp.bfloat16)
    write = jax.jit(kv_cache.write_kv, donate_argnums=0)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = write.lower(cache, 1, spec((512,), jnp.int32), rows, rows).compile().as_text()
    scatters = [line for line in hlo.splitlines() if " scatter(" in line]
    assert len(scatters) == 2 and all("unique_indices=true" in line for line in scatters)


def test_validation():
    cache = zero_cache(1, 4, 2, 3, 1, 2)
    with pytest.raises(ValueError, match="k has shape"):
        kv_cache.write_kv(cache, 0, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 1, 3)),
                          jnp.zeros((2, 2, 3)))  # fmt: skip
    with pytest.raises(ValueError, match="v has shape"):
        kv_cache.write_kv(cache, 0, jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2, 3)),
                          jnp.zeros((2, 2, 4)))  # fmt: skip
