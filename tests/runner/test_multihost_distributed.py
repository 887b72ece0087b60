"""DP-rank ownership and global arrays from local rows (8 CPU devices, one process)."""

import types

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtbo.collectives import mesh as mesh_lib
from jtbo.runner import distributed


def _fake_mesh(process_of_device, dp):
    """A duck-typed mesh whose devices report the given process indices."""
    devices = np.asarray([types.SimpleNamespace(process_index=p) for p in process_of_device])
    return types.SimpleNamespace(devices=devices.reshape(dp, -1), shape={mesh_lib.DP_AXIS: dp})


def test_owner_of_a_dp_rank_is_the_process_holding_its_row():
    mesh = _fake_mesh([0, 0, 0, 0, 1, 1, 1, 1], dp=4)
    owners = distributed.dp_rank_owners(mesh)
    assert owners == (0, 0, 1, 1)
    assert distributed.local_dp_ranks(owners, process_index=1) == (2, 3)
    with pytest.raises(ValueError, match=r"process 2 drives no DP rank"):
        distributed.local_dp_ranks(owners, process_index=2)


def test_a_dp_rank_across_processes_is_refused():
    with pytest.raises(ValueError, match=r"DP rank 1 spans processes \[0, 1\]"):
        distributed.dp_rank_owners(_fake_mesh([0, 0, 0, 1, 1, 1, 1, 1], dp=4))


def test_single_process_mesh_is_owned_entirely():
    mesh = mesh_lib.make_mesh(4, 2)
    assert distributed.dp_rank_owners(mesh) == (0, 0, 0, 0)
    assert not distributed.is_multiprocess(mesh)


@pytest.mark.parametrize("dp, tp", [(8, 1), (4, 2), (2, 4)])
def test_rank_rows_round_trip_through_a_global_array(dp, tp):
    mesh = mesh_lib.make_mesh(dp, tp)
    rng = np.random.default_rng(dp)
    rows = rng.standard_normal((dp, 3, 5)).astype(np.float32)
    ranks = tuple(rng.permutation(dp).tolist())  # any order of this process's ranks
    array = distributed.rank_sharded_array(mesh, rows, ranks, dp)
    want = np.empty_like(rows)
    want[list(ranks)] = rows
    assert array.sharding == NamedSharding(mesh, P(mesh_lib.DP_AXIS))
    np.testing.assert_array_equal(np.asarray(array), want)
    back = distributed.local_rank_rows(array, ranks[::-1])
    np.testing.assert_array_equal(back, rows[::-1])


def test_rows_must_cover_every_addressable_rank():
    mesh = mesh_lib.make_mesh(4, 2)
    with pytest.raises(ValueError, match=r"holds DP rank \d, not one of \(0, 1\)"):
        distributed.rank_sharded_array(mesh, np.zeros((2, 3)), (0, 1), 4)
    with pytest.raises(ValueError, match="got 3 rows for 2 ranks"):
        distributed.rank_sharded_array(mesh, np.zeros((3, 3)), (0, 1), 4)


def test_step_inputs_equal_the_host_trees():
    mesh = mesh_lib.make_mesh(4, 2)
    rng = np.random.default_rng(0)
    per_rank = dict(ids=rng.integers(0, 9, (4, 6)).astype(np.int32), n=np.arange(4, dtype=np.int32))
    replicated = dict(counts=rng.integers(0, 9, (4,)).astype(np.int32))
    got = distributed.global_step_inputs(mesh, per_rank, range(4), replicated, 4)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, got), (per_rank, replicated))
    assert got[1]["counts"].sharding.is_fully_replicated
    weights = rng.standard_normal((8, 4)).astype(np.float32)
    sharding = NamedSharding(mesh, P(mesh_lib.TP_AXES, None))
    placed = distributed.full_value_array(weights, sharding)
    assert placed.sharding == sharding
    np.testing.assert_array_equal(np.asarray(placed), weights)
