"""Multi-process (multi-host) placement: which DP ranks a process drives, and global arrays.

Under ``jax.distributed`` every process runs the same program over one global mesh, but a
process can only read and write the devices it can address. jtbo gives each DP rank (one row
of the ``("dp", "attn_tp")`` mesh) to exactly one process: **the process whose addressable
devices hold that row**. A row whose devices belong to several processes (attention TP across
hosts) is refused: its batch would have to be on every one of those hosts.

Step inputs are built from each process's own ranks only:

* per-rank inputs (leading ``dp`` axis, sharded over ``"dp"``, replicated over ``"attn_tp"``):
  every addressable device gets the row of the rank its shard covers
  (``jax.make_array_from_single_device_arrays``), so a process never needs another
  process's batch;
* replicated inputs (values every process knows: DP contexts, parameters): each process fills
  its own devices from its full host copy (``jax.make_array_from_callback``).

Outputs are read back from addressable shards only (``local_rank_rows``).
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtbo.collectives import mesh as mesh_lib


def dp_rank_owners(mesh: jax.sharding.Mesh) -> tuple[int, ...]:
    """The process that drives each DP rank: the one whose devices form that mesh row.

    Args:
      mesh: a ``("dp", "attn_tp")`` mesh.

    Returns:
      Per DP rank, a process index.

    Raises:
      ValueError: a DP rank whose devices belong to more than one process.
    """
    owners = []
    for rank, row in enumerate(np.asarray(mesh.devices).reshape(mesh.shape[mesh_lib.DP_AXIS], -1)):
        processes = sorted({device.process_index for device in row})
        if len(processes) != 1:
            raise ValueError(
                f"DP rank {rank} spans processes {processes}: every DP rank's attn_tp devices "
                "must be on one process (host); put attn_tp inside a host"
            )
        owners.append(processes[0])
    return tuple(owners)


def local_dp_ranks(owners: Sequence[int], process_index: int | None = None) -> tuple[int, ...]:
    """The DP ranks a process drives, in rank order.

    Args:
      owners: from ``dp_rank_owners``.
      process_index: the process; ``jax.process_index()`` when None.

    Returns:
      The ranks owned by that process.

    Raises:
      ValueError: the process owns no DP rank (it could not take part in the step).
    """
    process = jax.process_index() if process_index is None else process_index
    ranks = tuple(rank for rank, owner in enumerate(owners) if owner == process)
    if not ranks:
        raise ValueError(
            f"process {process} drives no DP rank of the mesh (rank owners {tuple(owners)}); "
            "build the mesh over every process's devices"
        )
    return ranks


def is_multiprocess(mesh: jax.sharding.Mesh) -> bool:
    """Whether the mesh has devices this process cannot address."""
    return any(device.process_index != jax.process_index() for device in mesh.devices.flat)


def rank_sharded_array(
    mesh: jax.sharding.Mesh, rows: np.ndarray, ranks: Sequence[int], dp_size: int
) -> jax.Array:
    """A global ``[dp_size, ...]`` array sharded over ``"dp"`` from this process's rows.

    Args:
      mesh: the ``("dp", "attn_tp")`` mesh.
      rows: ``[len(ranks), ...]`` host rows of this process's ranks, in ``ranks`` order.
      ranks: the DP ranks the rows belong to (every rank this process's devices hold).
      dp_size: DP ranks of the mesh.

    Returns:
      The global array; each addressable device holds its rank's row.

    Raises:
      ValueError: ``rows`` and ``ranks`` disagree, or a device's rank is not in ``ranks``.
    """
    rows = np.asarray(rows)
    if rows.shape[0] != len(ranks):
        raise ValueError(f"got {rows.shape[0]} rows for {len(ranks)} ranks {tuple(ranks)}")
    sharding = NamedSharding(mesh, P(mesh_lib.DP_AXIS))
    shape = (dp_size, *rows.shape[1:])
    position = {rank: i for i, rank in enumerate(ranks)}
    devices, shards = [], []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        rank = index[0].start
        if rank not in position:
            raise ValueError(f"device {device} holds DP rank {rank}, not one of {tuple(ranks)}")
        devices.append(device)
        shards.append(rows[position[rank]][None])
    return jax.make_array_from_single_device_arrays(
        shape, sharding, jax.device_put(shards, devices)
    )


def full_value_array(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from a value every process holds in full (parameters, DP contexts).

    Args:
      value: a host or process-local array, the same on every process.
      sharding: the target sharding (may span other processes' devices).

    Returns:
      The global array; this process fills only its own devices.
    """
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def global_step_inputs(
    mesh: jax.sharding.Mesh, per_rank: Any, ranks: Sequence[int], replicated: Any, dp_size: int
) -> tuple[Any, Any]:
    """Global arrays for a step from this process's per-rank rows and the replicated values.

    Args:
      mesh: the ``("dp", "attn_tp")`` mesh.
      per_rank: a pytree of ``[len(ranks), ...]`` host arrays (this process's ranks).
      ranks: the DP ranks of ``per_rank``'s rows.
      replicated: a pytree of host values every process holds in full.
      dp_size: DP ranks of the mesh.

    Returns:
      ``(per_rank, replicated)`` as global ``jax.Array`` pytrees.
    """
    replicated_sharding = NamedSharding(mesh, P())
    return (
        jax.tree.map(lambda rows: rank_sharded_array(mesh, rows, ranks, dp_size), per_rank),
        jax.tree.map(lambda value: full_value_array(value, replicated_sharding), replicated),
    )


def local_rank_rows(array: jax.Array, ranks: Sequence[int]) -> np.ndarray:
    """This process's ranks' rows of a global array sharded over ``"dp"`` (leading axis).

    Reads addressable shards only; of the ``attn_tp`` replicas of a row, the first is used.

    Args:
      array: a global ``[dp, ...]`` array sharded over ``"dp"``.
      ranks: DP ranks to read (all addressable by this process).

    Returns:
      ``[len(ranks), ...]`` numpy rows in ``ranks`` order.

    Raises:
      ValueError: a rank with no addressable shard.
    """
    found = {}
    for shard in array.addressable_shards:
        start = shard.index[0].start or 0
        for offset in range(shard.data.shape[0]):
            found.setdefault(start + offset, (shard, offset))
    missing = [rank for rank in ranks if rank not in found]
    if missing:
        raise ValueError(f"DP ranks {missing} have no shard on process {jax.process_index()}")
    return np.stack([np.asarray(found[r][0].data)[found[r][1]] for r in ranks])
