"""One measurement: the inputs built once, then every collective's three programs compiled,
checked against the references and timed; ``--profile`` traces after all timings."""

import argparse
import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jtbo.bench.overlap import check as check_lib
from jtbo.bench.overlap import collectives as collectives_lib
from jtbo.bench.overlap import inputs as inputs_lib
from jtbo.bench.overlap import profiling, programs, reference, results, timing
from jtbo.bench.overlap import sizes as sizes_lib
from jtbo.overlap import xla_options


@dataclasses.dataclass(frozen=True)
class ProbeInputs:
    """The random inputs of one measurement, shared by its collectives."""

    comm: dict[int, jax.Array]  # rows per device -> the collective chain's input
    y: jax.Array
    w: jax.Array
    matmul_check: reference.MatmulCheck
    seed: int


def make_inputs(mesh, sizes: sizes_lib.ProbeSizes, names: Sequence[str], seed: int) -> ProbeInputs:
    """Builds every input once: collectives of one input size share it (host generation of
    a 448 MiB block takes seconds)."""
    dtype = jnp.dtype(sizes.dtype)
    all_rows = {sizes_lib.comm_input_rows(collectives_lib.COLLECTIVES[name], sizes, mesh.size)
                for name in names}  # fmt: skip
    comm = {rows: inputs_lib.comm_input(mesh, rows, seed, dtype) for rows in all_rows}
    y, w = inputs_lib.matmul_inputs(mesh, sizes, seed)
    return ProbeInputs(comm, y, w, reference.matmul_check(y, sizes, seed), seed)


def probe_collective(
    collective, mesh, sizes, options, probe_inputs: ProbeInputs, variant: str, windows: str
):
    """Compiles, checks and times one collective's three programs.

    Args:
      collective: the probed ``Collective``.
      mesh: the 1-D probe mesh.
      sizes: ``resolve_sizes``.
      options: compile options.
      probe_inputs: ``make_inputs``.
      variant: the variant's name, for the result.
      windows: ``--windows`` of the both program (``WINDOW_MODES``).

    Returns:
      ``(ProbeResult, runs)``: ``runs`` maps "comm", "compute" and "both" to a zero-argument
      run of that program (for profiling).

    Raises:
      RuntimeError: an output differs from its numpy reference.
    """
    chain = sizes.chain
    x = probe_inputs.comm[sizes_lib.comm_input_rows(collective, sizes, mesh.size)]
    inputs = (x, probe_inputs.y, probe_inputs.w)
    runs = programs.programs(collective, mesh, chain, 0, inputs, options, ["comm"])
    matmuls = sizes.matmuls_per_window or timing.calibrate_matmuls_per_window(
        runs["comm"], collective, mesh, sizes, inputs, options
    )
    runs |= programs.programs(
        collective, mesh, chain, matmuls, inputs, options, ["compute", "both"], windows
    )
    expected = reference.expected(
        collective, sizes, mesh.size, probe_inputs.seed, matmuls, probe_inputs.matmul_check
    )
    outputs = {k: run() for k, run in runs.items()}
    check_lib.check_programs(collective.name, outputs, expected, sizes)
    times = timing.median_seconds([runs["comm"], runs["compute"], runs["both"]], sizes.iters)
    result = results.ProbeResult(
        variant, collective.name, windows, sizes.bytes_per_exchange, chain, matmuls, *times
    )
    return result, runs


def _run_info(sizes: sizes_lib.ProbeSizes, windows: str) -> results.RunInfo:
    device = jax.devices()[0]
    return results.RunInfo(
        len(jax.devices()), device.device_kind, device.platform, jax.process_count(),
        jax.__version__, sizes.bytes_per_exchange, sizes.matmul, sizes.chain, sizes.iters,
        sizes.dtype, windows,
    )  # fmt: skip


def _probe_mesh() -> jax.sharding.Mesh:
    """Every device (of every process) on one axis, ``PROBE_AXIS``."""
    devices = jax.devices()
    return jax.make_mesh((len(devices),), (collectives_lib.PROBE_AXIS,), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))  # fmt: skip


def measure(args: argparse.Namespace, variant: str, emit: Callable[[str, object], None]) -> None:
    """Probes every ``--collectives`` entry in this process (and its ``jax.distributed``
    peers), calling ``emit("info", RunInfo)`` once and ``emit("result", ProbeResult)`` per
    collective on process 0.

    Raises:
      RuntimeError: a program's output differs from its numpy reference.
      ValueError: bad ``--bytes`` or an unbalanceable matmul count.
    """
    mesh = _probe_mesh()
    sizes = sizes_lib.resolve_sizes(args, jax.devices()[0].platform, mesh.size)
    leader = jax.process_index() == 0
    if leader:
        emit("info", _run_info(sizes, args.windows))
    options = dict(xla_options.parse_option(text) for text in args.xla_option)
    probe_inputs = make_inputs(mesh, sizes, args.collectives, args.seed)
    to_profile = []
    for name in args.collectives:
        result, runs = probe_collective(
            collectives_lib.COLLECTIVES[name], mesh, sizes, options, probe_inputs,
            variant, args.windows,
        )  # fmt: skip
        if leader:
            emit("result", result)
        # The comm-alone program too: its wall time minus its kernels' is the fixed cost
        # (launch, the exchange's host side) that ``hidden`` counts as communication.
        to_profile += [(f"{variant}_{name}_{p}", runs[p]) for p in profiling.PROFILED_PROGRAMS]
    # Traces come after every timing: the profiler's hooks may slow later runs.
    for label, run in to_profile if args.profile else []:
        lines = profiling.profile_program(run, args.profile, label)
        if leader:
            print("\n".join(lines), flush=True)
