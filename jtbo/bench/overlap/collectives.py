"""The probed collectives: each one's chain step inside ``shard_map`` and its numpy twin.

Each collective is split into its exchange and the elementwise step after it: pinned
windows put a barrier between the two (see the package docstring). XLA's collectives are one
call whose start and done XLA places; ``all_to_all_peer_copy`` (``jtbo.collectives.
peer_copy``) is an explicit start and wait, and the barrier sits between those.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.collectives import mesh as mesh_lib
from jtbo.collectives import peer_copy

PROBE_AXIS = "x"
"""The mesh axis every probe program runs its collectives over."""


def _all_to_all_exchange(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, PROBE_AXIS, 0, 0, tiled=True)


def _all_to_all_finish(received: jax.Array, sent: jax.Array, ndev: int) -> jax.Array:
    del ndev
    # Overwrites the first received row with the negated first sent row, in place: the next
    # exchange depends on this one, yet the chain's serial part is the exchange itself. A
    # pass over the whole buffer could never run beside the window's compute and would cap
    # ``hidden`` below 1 for a collective that hides completely. The new row is read from
    # ``sent``, not from ``received``: XLA:GPU updates a buffer in place only when the
    # update reads nothing else of it, and a static slice of the same buffer (what
    # ``received.at[0].multiply(-1)`` becomes) made it rewrite all of it (docs/benchmarks/,
    # "Peer-copy TBO with the Pallas kernels", the probe, has the cost). Negation is exact;
    # the block order is checked on every row by the reference.
    return received.at[0].set(-sent[0])


def _all_to_all_reference(x: np.ndarray) -> np.ndarray:
    ndev, rows, k = x.shape
    blocks = x.reshape(ndev, ndev, rows // ndev, k).swapaxes(0, 1)  # [receiver, sender]
    received = blocks.reshape(ndev, rows, k).copy()
    received[:, 0] = -x[:, 0]
    return received


def _chunk_weights(ndev: int) -> np.ndarray:
    """Distinct weights 1..ndev: a weighted mean notices chunks in the wrong order."""
    return np.arange(1, ndev + 1, dtype=np.float32)


def _all_gather_exchange(x: jax.Array) -> jax.Array:
    return jax.lax.all_gather(x, PROBE_AXIS, tiled=True)


def _all_gather_finish(received: jax.Array, sent: jax.Array, ndev: int) -> jax.Array:
    del sent
    gathered = received.reshape(ndev, received.shape[0] // ndev, *received.shape[1:])
    weights = _chunk_weights(ndev)
    # Reads every received byte and shrinks back to the input size for the next exchange.
    # With bfloat16 inputs and integer weights, every product and partial sum is exact in
    # float32 (up to 256 devices), so the sum is the same in any order or fusion: pinned
    # and free windows give the same bits. Only the division by the weights' sum rounds.
    total = (gathered.astype(jnp.float32) * jnp.asarray(weights)[:, None, None]).sum(axis=0)
    return (total / weights.sum()).astype(received.dtype)


def _all_gather_reference(x: np.ndarray) -> np.ndarray:
    weights = _chunk_weights(x.shape[0])
    mean = (x * weights[:, None, None]).sum(axis=0) / weights.sum()
    return np.broadcast_to(mean, x.shape).copy()


def _psum_scatter_exchange(x: jax.Array) -> jax.Array:
    return jax.lax.psum_scatter(x, PROBE_AXIS, scatter_dimension=0, tiled=True)


def _psum_scatter_finish(received: jax.Array, sent: jax.Array, ndev: int) -> jax.Array:
    del sent
    # Back to the input size; dividing by ndev keeps the values in [1, 2).
    return jnp.tile(received, (ndev, 1)) / jnp.asarray(ndev, received.dtype)


def _psum_scatter_reference(x: np.ndarray) -> np.ndarray:
    ndev, rows, k = x.shape
    summed = x.reshape(ndev, ndev, rows // ndev, k).sum(axis=0)  # [receiver]: over senders
    return np.tile(summed, (1, ndev, 1)) / ndev


def _received(in_flight: jax.Array) -> jax.Array:
    """XLA's collectives: the issued value is the received one (XLA places the wait)."""
    return in_flight


@dataclasses.dataclass(frozen=True)
class Collective:
    """One probed collective: its chain step inside ``shard_map`` (the exchange, then an
    elementwise finish) and its numpy twin."""

    name: str
    exchange: Callable[[jax.Array], Any]  # x -> the issued exchange (XLA's: the received x)
    # (received, sent x, ndev) -> the next x, of x's shape
    finish: Callable[[jax.Array, jax.Array, int], jax.Array]
    reference: Callable[[np.ndarray], np.ndarray]  # (ndev, rows, k) -> the same, on the host
    input_is_shard: bool  # the input is bytes / ndev (all-gather), not bytes
    wait: Callable[[Any], jax.Array] = _received  # the issued exchange -> what was received

    @property
    def explicit_wait(self) -> bool:
        """Whether the exchange is an explicit start and wait (the peer copy), not XLA's."""
        return self.wait is not _received

    def step(self, x: jax.Array, ndev: int) -> jax.Array:
        """One link of the collective chain: the exchange, its wait and its finish."""
        return self.finish(self.wait(self.exchange(x)), x, ndev)

    def bind(self, mesh: jax.sharding.Mesh) -> "Collective":
        """This collective over ``mesh``'s devices (the peer copy needs their ordinals)."""
        if self.name != "all_to_all_peer_copy":
            return self
        group, platform = peer_copy.device_group(mesh), mesh_lib.mesh_platform(mesh)
        return dataclasses.replace(
            self,
            exchange=lambda x: peer_copy.all_to_all_start(x, group, platform),
            wait=lambda in_flight: peer_copy.all_to_all_wait(in_flight, group),
        )


def _unbound(x: jax.Array) -> jax.Array:
    raise ValueError("all_to_all_peer_copy needs the mesh's devices: use Collective.bind")


COLLECTIVES = {
    c.name: c
    for c in (
        Collective("all_to_all", _all_to_all_exchange, _all_to_all_finish,
                   _all_to_all_reference, False),
        Collective("all_to_all_peer_copy", _unbound, _all_to_all_finish,
                   _all_to_all_reference, False),
        Collective("all_gather", _all_gather_exchange, _all_gather_finish,
                   _all_gather_reference, True),
        Collective("psum_scatter", _psum_scatter_exchange, _psum_scatter_finish,
                   _psum_scatter_reference, False),
    )
}  # fmt: skip
