"""All-to-all by peer copies on a side stream: an exchange that runs beside compute.

XLA runs its own collectives as NCCL kernels, which take streaming multiprocessors from the
compute they are meant to overlap and are ordered by XLA's scheduler (docs/benchmarks/, "Run-time
overlap on two H200s"). This exchange is a pair of XLA FFI custom calls
(``jtbo/ffi/peer_exchange_*.cc``):

* ``all_to_all_start(x, group)``: every device of ``group`` pushes block ``p`` of its ``x``
  into block ``rank`` of device ``p``'s receive buffer, by copy-engine transfers on a side
  stream (GPU; memcpy on the CPU build). It returns at once; the receive buffer must not be
  read yet.
  ``JTBO_PEER_COPY_STREAMS=N`` (read once per process, default 1) cuts each block over N
  side streams, so that several copy engines can move it. ``JTBO_PEER_COPY_VIA_HOST=1`` (read
  at every start; every device of an exchange must agree) stages the exchange through pinned
  host memory instead, as an inter-host link would: each device copies its send buffer to
  the host (device to host), then every device copies the blocks addressed to it back (host
  to device), still on copy engines beside compute. ``bench tbo --link host`` sets it.
* ``all_to_all_wait(in_flight)``: the compute stream waits until every block has landed (and
  ``x`` has been read). Its result aliases the receive buffer.

Whatever the compiled program runs between the two calls overlaps the exchange; both calls
are side-effecting, so XLA keeps them and their order. The wait takes ``x`` as an operand so
that XLA keeps ``x`` alive while the copies read it. The group must be every device of one
process (a single-process mesh): the copies address the peers' buffers directly.

``InFlight`` also carries XLA's exchanges through ``jtbo.collectives.ep_dispatch`` (with
``sent=None``): the dispatch's halves hand one type between them whatever the exchange.

Each exchange's start and wait run under one name scope, ``jtbo.ffi.build.EXCHANGE_SCOPE``
and a number unique in the process, so that tools reading the compiled HLO pair them by
their ``op_name`` metadata, whatever XLA puts
between the two calls' operands.
"""

import dataclasses
import itertools

import jax
import numpy as np

from jtbo import ffi

_exchange_numbers = itertools.count()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InFlight:
    """An exchange that has been issued and not yet waited for."""

    received: jax.Array  # [rows, ...] the landing buffer (peer copy: read only after the wait)
    sent: jax.Array | None  # [rows, ...] the rows being sent (peer copy only), else None
    # The peer copy's number (its start's and wait's name scope), else None.
    exchange: int | None = dataclasses.field(default=None, metadata=dict(static=True))


def device_group(mesh: jax.sharding.Mesh) -> tuple[int, ...]:
    """The local device ordinals of ``mesh``'s devices in mesh order: the exchange group.

    Args:
      mesh: a mesh whose devices all belong to this process (CPU or CUDA devices).

    Returns:
      ``local_hardware_id`` of each device, in ``mesh.devices.flat`` order; for devices that
      are described, not present (``jtbo.aot`` compiles for GPUs on a CPU), their ``id``:
      such a program is compiled and read, never run.

    Raises:
      ValueError: a device of another process, or a platform without the FFI build.
    """
    devices = list(mesh.devices.flat)
    platform = devices[0].platform
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"the peer-copy exchange runs on CPU or CUDA devices, not {platform!r}")
    foreign = [d for d in devices if d.process_index != jax.process_index()]
    if foreign:
        raise ValueError(
            f"the peer-copy exchange needs every device in this process; {foreign} belong to "
            "other processes (use an XLA exchange across processes)"
        )
    described = [d.local_hardware_id is None for d in devices]
    if any(described) and not all(described):
        raise ValueError(f"the mesh mixes present and described devices: {devices}")
    return tuple(int(d.id if d.local_hardware_id is None else d.local_hardware_id) for d in devices)


def all_to_all_start(x: jax.Array, group: tuple[int, ...], platform: str) -> InFlight:
    """Issues the all-to-all of ``x``'s ``len(group)`` row blocks (inside ``shard_map``).

    Args:
      x: ``[rows, ...]`` this device's rows; block ``p`` (``rows / len(group)`` rows) goes to
        device ``group[p]``.
      group: the exchange's devices (``device_group``), the same on every device.
      platform: "cpu" or "gpu", the platform the program compiles for.

    Returns:
      The exchange in flight; pass it to ``all_to_all_wait``.

    Raises:
      ValueError: rows not a multiple of the group size.
      jtbo.ffi.FfiBuildError: the handlers cannot be built here.
    """
    if x.ndim < 1 or x.shape[0] % len(group):
        raise ValueError(f"x shape {x.shape}: rows must be a multiple of {len(group)} devices")
    ffi.register_peer_exchange(platform)
    start = jax.ffi.ffi_call(
        ffi.build.START_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True
    )
    exchange = next(_exchange_numbers)
    with jax.named_scope(f"{ffi.build.EXCHANGE_SCOPE}{exchange}"):
        received = start(x, group=np.asarray(group, np.int64))
    return InFlight(received=received, sent=x, exchange=exchange)


def all_to_all_wait(in_flight: InFlight, group: tuple[int, ...]) -> jax.Array:
    """Waits for ``all_to_all_start``'s exchange; block ``s`` of the result came from ``s``.

    Args:
      in_flight: ``all_to_all_start``'s result.
      group: the same group as the start's.

    Returns:
      ``[rows, ...]`` the received rows.

    Raises:
      ValueError: ``in_flight`` is not a peer-copy exchange (no ``sent`` rows or number).
    """
    if in_flight.sent is None or in_flight.exchange is None:
        raise ValueError("all_to_all_wait takes the InFlight of all_to_all_start")
    wait = jax.ffi.ffi_call(
        ffi.build.WAIT_TARGET,
        jax.ShapeDtypeStruct(in_flight.received.shape, in_flight.received.dtype),
        has_side_effect=True,
        input_output_aliases={1: 0},
    )
    with jax.named_scope(f"{ffi.build.EXCHANGE_SCOPE}{in_flight.exchange}"):
        received = wait(in_flight.sent, in_flight.received, group=np.asarray(group, np.int64))
    # XLA:GPU's dynamic-slice fusion takes a custom call followed by a dynamic-update-slice
    # for a library call that writes its result in place, and fails to compile when the
    # call's result is the update's target instead (jax 0.11.2: "DUS target must be a fusion
    # parameter"). The barrier (no copy, no work) keeps ``received.at[i].set(...)`` legal.
    return jax.lax.optimization_barrier(received)
