"""The probe programs on the CPU (8 devices): pinned and free windows computing the same
chains, and the barriers that pin them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.bench import overlap
from jtbo.bench.overlap import cli, programs, sizes
from tests.bench.overlap import runs


def _both_outputs(name: str, windows: str) -> list[np.ndarray]:
    """The both program's two chain outputs for ``TINY`` sizes, run on the 8 CPU devices."""
    args = cli.parser().parse_args([*runs.TINY, "--collectives", name])
    mesh = jax.make_mesh((len(jax.devices()),), (overlap.PROBE_AXIS,),
                         axis_types=(jax.sharding.AxisType.Auto,))  # fmt: skip
    probe_sizes = overlap.resolve_sizes(args, "cpu", mesh.size)
    probe_inputs = overlap.make_inputs(mesh, probe_sizes, [name], args.seed)
    collective = overlap.COLLECTIVES[name]
    x = probe_inputs.comm[sizes.comm_input_rows(collective, probe_sizes, mesh.size)]
    inputs = (x, probe_inputs.y, probe_inputs.w)
    matmuls = probe_sizes.matmuls_per_window
    both = programs.programs(
        collective, mesh, probe_sizes.chain, matmuls, inputs, {}, ["both"], windows
    )
    return [np.asarray(out) for out in both["both"]()]


@pytest.mark.parametrize("name", list(overlap.COLLECTIVES))
def test_pinned_and_free_windows_compute_identical_chains(name):
    """The barriers are identities: the same ops in the same order, so bit for bit equal."""
    pinned, free = (_both_outputs(name, windows) for windows in ("pinned", "free"))
    for got, want in zip(pinned, free, strict=True):
        np.testing.assert_array_equal(got, want)


def test_pinned_windows_put_two_barriers_in_each_window():
    """Pinned: one barrier before each window's collective and matmuls, one after; free:
    none (XLA's scheduler decides)."""
    collective = overlap.COLLECTIVES["all_to_all"]
    x, y = jnp.ones((8, 4)), jnp.ones((4, 4))

    def barriers(windows: str) -> int:
        body = overlap.BOTH_BODIES[windows]
        jaxpr = jax.make_jaxpr(lambda x, y: body(x, y, y, collective, 3, 2, 8),
                               axis_env=[(overlap.PROBE_AXIS, 8)])(x, y)  # fmt: skip
        return str(jaxpr).count("optimization_barrier")

    assert barriers("pinned") == 6 and barriers("free") == 0
