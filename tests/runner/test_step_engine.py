"""step_engine.sharded_zeros: zeros made in place with their sharding, one program per
sharding, a bounded number kept."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtbo.runner import step_engine


def _mesh(devices):
    return jax.sharding.Mesh(np.asarray(devices), ("dp",))


def test_zeros_have_their_sharding_and_share_one_program_per_sharding():
    sharding = NamedSharding(_mesh(jax.devices()[:4]), P("dp", None))
    step_engine._zeros_program.cache_clear()
    first = step_engine.sharded_zeros((8, 3), jnp.bfloat16, sharding)
    second = step_engine.sharded_zeros([4, 5], "int32", sharding)
    assert first.sharding == sharding and second.sharding == sharding
    assert (first.shape, first.dtype, second.shape, second.dtype) == (
        (8, 3), jnp.bfloat16, (4, 5), jnp.int32
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(first, np.float32), np.zeros((8, 3)))
    np.testing.assert_array_equal(np.asarray(second), np.zeros((4, 5)))
    # Each device holds its own rows only: made in place, not gathered on one device.
    assert {s.data.shape for s in first.addressable_shards} == {(2, 3)}
    info = step_engine._zeros_program.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_the_programs_of_shardings_no_longer_used_are_dropped():
    step_engine._zeros_program.cache_clear()
    limit = step_engine._ZEROS_PROGRAMS
    devices = jax.devices()
    for i in range(limit + 3):
        # distinct shardings: a mesh of one device, axis names made distinct per sharding
        mesh = jax.sharding.Mesh(np.asarray(devices[i % len(devices) : i % len(devices) + 1]),
                                 (f"dp{i}",))  # fmt: skip
        zeros = step_engine.sharded_zeros((2,), jnp.float32, NamedSharding(mesh, P()))
        np.testing.assert_array_equal(np.asarray(zeros), np.zeros(2))
    assert step_engine._zeros_program.cache_info().currsize == limit
