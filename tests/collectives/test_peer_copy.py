"""The peer-copy all-to-all against XLA's all_to_all and a numpy reference, on the platform
the tests run on: the CPU build (memcpy between the 8 CPU devices' buffers) under ``make
test``, the CUDA build (copy-engine copies between the GPUs) with ``JAX_PLATFORMS=cuda``."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jtbo import aot
from jtbo.collectives import ep_config, peer_copy
from jtbo.collectives import mesh as mesh_lib

AXIS = "x"
NDEV = min(8, jax.device_count())  # 8 CPU devices, or the GPUs of the host


def _mesh():
    return jax.make_mesh((NDEV,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def _sharded(body, mesh, outputs):
    spec = P(AXIS)
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(spec, spec),
                      out_specs=(spec,) * outputs, check_vma=False)
    )  # fmt: skip


def _reference(x: np.ndarray) -> np.ndarray:
    """Block ``p`` of device ``s``'s rows lands as block ``s`` of device ``p``'s result."""
    ndev = x.shape[0]
    blocks = x.reshape(ndev, ndev, x.shape[1] // ndev, *x.shape[2:]).swapaxes(0, 1)
    return blocks.reshape(x.shape)


@pytest.fixture(params=["direct", "via_host"])
def staging(request, monkeypatch):
    """Both transports: straight into the peers' buffers, and staged through host memory
    (``JTBO_PEER_COPY_VIA_HOST=1``, read by every start)."""
    monkeypatch.setenv("JTBO_PEER_COPY_VIA_HOST", "1" if request.param == "via_host" else "0")
    return request.param


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_start_and_wait_equal_xla_all_to_all(dtype, staging):
    mesh = _mesh()
    group = peer_copy.device_group(mesh)

    def body(x, y):
        in_flight = peer_copy.all_to_all_start(x, group, mesh_lib.mesh_platform(mesh))
        busy = jnp.tanh(y) @ jnp.tanh(y).T  # work between start and wait
        received = peer_copy.all_to_all_wait(in_flight, group)
        return received, jax.lax.all_to_all(x, AXIS, 0, 0, tiled=True), busy

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((NDEV * 16, 3, 5)) * 100).astype(dtype)
    y = rng.standard_normal((NDEV * 4, 4)).astype(np.float32)
    received, xla, _ = _sharded(body, mesh, 3)(x, y)
    want = _reference(np.asarray(x).reshape(NDEV, 16, 3, 5))
    np.testing.assert_array_equal(np.asarray(received).reshape(want.shape), want)
    np.testing.assert_array_equal(np.asarray(received), np.asarray(xla))


def test_interleaved_exchanges_each_find_their_own_buffer_over_repeated_runs(staging):
    # Two exchanges in flight at once, waited for in the other order (as two TBO
    # micro-batches' would be), in a program run three times.
    mesh = _mesh()
    group = peer_copy.device_group(mesh)

    def body(a, b):
        first = peer_copy.all_to_all_start(a, group, mesh_lib.mesh_platform(mesh))
        second = peer_copy.all_to_all_start(b, group, mesh_lib.mesh_platform(mesh))
        got_b = peer_copy.all_to_all_wait(second, group)
        got_a = peer_copy.all_to_all_wait(first, group)
        return got_a, got_b

    step = _sharded(body, mesh, 2)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        a, b = (rng.standard_normal((NDEV * 8, 4)).astype(np.float32) for _ in range(2))
        got_a, got_b = step(a, b)
        for got, sent in ((got_a, a), (got_b, b)):
            want = _reference(sent.reshape(NDEV, 8, 4))
            np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)


@pytest.mark.skipif(NDEV == 1, reason="any row count splits into a group of one device")
def test_rows_must_split_into_the_group():
    mesh = _mesh()
    with pytest.raises(ValueError, match=f"multiple of {NDEV} devices"):
        peer_copy.all_to_all_start(
            jnp.ones((NDEV * 3 + 1, 2)), peer_copy.device_group(mesh), mesh_lib.mesh_platform(mesh)
        )


def test_device_group_refuses_other_platforms_and_processes():
    fake = functools.partial(types.SimpleNamespace, local_hardware_id=0)
    tpu = types.SimpleNamespace(devices=np.array([fake(platform="tpu", process_index=0)]))
    with pytest.raises(ValueError, match="CPU or CUDA"):
        peer_copy.device_group(tpu)
    remote = fake(platform="cpu", process_index=jax.process_index() + 1)
    with pytest.raises(ValueError, match="other processes"):
        peer_copy.device_group(types.SimpleNamespace(devices=np.array([remote])))


def test_device_group_of_described_devices_is_their_ids():
    # jtbo.aot's devices (GPUs described to XLA on a CPU) have no hardware id: a program for
    # them is compiled and read, never run, so their ids stand in for the ordinals.
    described = functools.partial(
        types.SimpleNamespace, platform="gpu", process_index=jax.process_index(),
        local_hardware_id=None,
    )  # fmt: skip
    mesh = types.SimpleNamespace(devices=np.array([described(id=5), described(id=7)]))
    assert peer_copy.device_group(mesh) == (5, 7)
    present = types.SimpleNamespace(
        platform="gpu", process_index=jax.process_index(), local_hardware_id=0, id=0
    )
    mixed = types.SimpleNamespace(devices=np.array([described(id=5), present]))
    with pytest.raises(ValueError, match="mixes present and described devices"):
        peer_copy.device_group(mixed)
    if aot.aot_available():  # jtbo.aot's own devices: 2 H200s described on this host
        h200 = aot.gpu_mesh((2,), ("x",))
        assert peer_copy.device_group(h200) == tuple(d.id for d in h200.devices.flat)


def test_dispatcher_needs_the_group_exactly_for_the_peer_copy():
    base = dict(num_experts=16, ep_size=NDEV, num_tokens=4, top_k=2, peer_capacity=4,
                expert_capacity=4)  # fmt: skip
    with pytest.raises(ValueError, match="peer-copy exchange needs"):
        ep_config.EpDispatcher(**base, exchange="peer_copy")
    with pytest.raises(ValueError, match="peer-copy exchange needs"):
        ep_config.EpDispatcher(**base, exchange="dense", device_group=tuple(range(NDEV)))
    built = ep_config.create_ep_dispatcher(
        _mesh(), num_experts=16, num_tokens=4, top_k=2, exchange="peer_copy"
    )
    assert built.device_group == peer_copy.device_group(_mesh())
