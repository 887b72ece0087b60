"""The three probe programs (comm alone, compute alone, both), each one ``jax.shard_map``
over the 1-D probe mesh, and the both program's pinned or free windows."""

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

from jtbo.bench.overlap import collectives as collectives_lib

Collective = collectives_lib.Collective

WINDOW_MODES = ("pinned", "free")
"""``--windows``: the both program's windows tied by barriers, or left to XLA (package
docstring)."""


def comm_chain(x: jax.Array, collective: Collective, chain: int, ndev: int) -> jax.Array:
    """``chain`` collectives, each with its elementwise finish."""
    for _ in range(chain):
        x = collective.step(x, ndev)
    return x


def matmul_chain(y: jax.Array, w: jax.Array, count: int) -> jax.Array:
    """``count`` dependent matmuls ``y <- y @ w``."""
    for _ in range(count):
        y = y @ w
    return y


def _free_windows(x, y, w, collective: Collective, chain: int, matmuls: int, ndev: int):
    """Both chains as independent dataflow: XLA's scheduler alone decides what overlaps."""
    return comm_chain(x, collective, chain, ndev), matmul_chain(y, w, chain * matmuls)


def _pinned_windows(x, y, w, collective: Collective, chain: int, matmuls: int, ndev: int):
    """Both chains, window k of the collective chain pinned beside window k of the matmul
    chain by barriers (see the package docstring); the same values as ``_free_windows``.

    Returns:
      ``(x, y)`` after ``chain`` windows of one collective and ``matmuls`` matmuls each.
    """
    for _ in range(chain):
        # Collective k cannot start before window k's matmul input is ready, nor its
        # matmuls before collective k's input is: the two are issued together.
        x, y = jax.lax.optimization_barrier((x, y))
        in_flight = collective.exchange(x)
        if collective.explicit_wait:
            # An explicit start is an ordinary call to XLA's scheduler: pin it before the
            # window's matmuls (XLA's own collectives cannot be pinned so: the barrier
            # would wait for their result).
            in_flight, y = jax.lax.optimization_barrier((in_flight, y))
        in_flight, y = jax.lax.optimization_barrier((in_flight, matmul_chain(y, w, matmuls)))
        # Past the barrier: collective k is done before window k + 1's matmuls (which read
        # y) start, and its finish waits for window k's matmuls, so one block per window.
        x = collective.finish(collective.wait(in_flight), x, ndev)
    return x, y


BOTH_BODIES = {"pinned": _pinned_windows, "free": _free_windows}
"""``--windows`` -> the both program's body, ``(x, y, w, collective, chain, matmuls, ndev)
-> (x, y)``."""


def _compile(body, mesh, inputs: Sequence[jax.Array], outputs: int, options: dict):
    """``body`` as one ``shard_map`` over the mesh, jitted and compiled with ``options``."""
    spec = P(collectives_lib.PROBE_AXIS)
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(spec,) * len(inputs),
        out_specs=spec if outputs == 1 else (spec,) * outputs, check_vma=False,
    )  # fmt: skip
    return jax.jit(mapped).lower(*inputs).compile(compiler_options=options)


def programs(
    collective, mesh, chain: int, matmuls: int, inputs, options, names, windows: str = "free"
) -> dict:
    """Zero-argument runs of the named programs among comm, compute and both, compiled with
    ``options`` (``inputs``: x, y, w); ``windows`` (``WINDOW_MODES``) shapes only both."""
    x, y, w = inputs
    collective = collective.bind(mesh)

    def comm(x):
        return comm_chain(x, collective, chain, mesh.size)

    def compute(y, w):
        return matmul_chain(y, w, chain * matmuls)

    def both(x, y, w):
        return BOTH_BODIES[windows](x, y, w, collective, chain, matmuls, mesh.size)

    bodies = {"comm": (comm, (x,), 1), "compute": (compute, (y, w), 1), "both": (both, inputs, 2)}
    runs = {}
    for name in names:
        body, args, outputs = bodies[name]
        compiled = _compile(body, mesh, args, outputs, options)
        runs[name] = lambda compiled=compiled, args=args: compiled(*args)
    return runs
