"""Test harness: run a local-shard function over the ("dp", "attn_tp") mesh on 8 CPU devices.

Arrays go in stacked device by device (``[num_devices * rows, ...]``, sharded over the whole
TP group in tp_rank order) and come out the same way, so a test sees every device's shard.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jtbo.collectives import mesh as mesh_lib
from tests import xla_flags

LAYOUTS = ((8, 1), (4, 2), (2, 4), (1, 8))


def mesh(dp_size, attn_tp_size):
    """The ``(dp, attn_tp)`` mesh; skips the test where fewer devices exist (a GPU host:
    ``JAX_PLATFORMS=cuda pytest`` runs the tests its devices can hold)."""
    needed = dp_size * attn_tp_size
    if len(jax.devices()) < needed:
        pytest.skip(f"needs {needed} devices, {len(jax.devices())} here")
    return _mesh(dp_size, attn_tp_size)


@functools.cache
def _mesh(dp_size, attn_tp_size):
    return mesh_lib.make_mesh(dp_size, attn_tp_size)


@functools.cache
def sharded(fn, dp_size, attn_tp_size, num_arrays, num_outputs):
    """jit(shard_map(fn)) taking ``num_arrays`` per-device arrays and a replicated context."""

    def body(context, *arrays):
        return fn(context, *arrays)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh(dp_size, attn_tp_size),
            in_specs=(P(),) + (P(mesh_lib.TP_AXES),) * num_arrays,  # context; per-device arrays
            out_specs=(P(mesh_lib.TP_AXES),) * num_outputs,
            check_vma=False,
        ),
        # Collectives move bits (ids bitcast into rows): compiled as users' programs are.
        compiler_options=xla_flags.XLA_DEFAULT_OPTIMIZATION,
    )


def per_device(stacked, num_devices):
    """Splits a stacked output back into ``[num_devices, rows, ...]``."""
    stacked = np.asarray(stacked)
    return stacked.reshape((num_devices, -1) + stacked.shape[1:])
