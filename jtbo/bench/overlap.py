"""``python -m jtbo.bench overlap``: does an async collective run beside independent compute?

Two-batch overlap only pays if, at run time, a collective's transfer proceeds while the GPU
computes something else. This probe measures that directly, one collective at a time
(``--collectives``, default ``all_to_all,all_gather,psum_scatter``), with three jitted
programs, each one ``jax.shard_map`` over every device (a 1-D mesh, axis ``PROBE_AXIS``):

- comm alone: a chain of ``--chain`` collectives on a per-device buffer, each waiting for the
  last through a small elementwise step (``all_to_all``: negate; ``all_gather``: a weighted
  mean of the gathered chunks, back to the input size; ``psum_scatter``: tile the scattered
  chunk ``ndev`` times and divide by ``ndev``, back to the input size);
- compute alone: ``--chain`` windows of ``--matmuls-per-window`` dependent square matmuls
  ``y <- y @ w`` (``--matmul N``), touching none of the collective's data;
- both: the two chains in one program, the collective chain's window k beside the matmul
  chain's window k; ``--windows`` says how the windows are kept (below).

``--windows pinned`` (the default) ties the two chains together at every window edge with
``jax.lax.optimization_barrier``: ``x, y = barrier((x, y))`` before collective k is issued
on ``x`` and window k's matmul block runs on ``y``, then ``received, y = barrier((collective
out, matmul block out))`` before the elementwise step that feeds collective k + 1. So
collective k can start only once window k's matmul input is ready, and must be done before
window k + 1's matmuls start: each collective's start/done window holds exactly one matmul
block, by data dependence. ``--windows free`` runs the two chains as independent dataflow
(one body returns both) and leaves the interleaving to XLA's scheduler. Pinned is the
default because the probe asks whether the exchange *can* run beside compute, given a
schedule that asks for it (as the TBO step's barriers do): with free windows XLA's
latency-hiding scheduler, which estimates a collective as short, puts about one matmul
inside each start/done window, and a GPU runs that schedule in order on one compute stream,
so ``hidden`` then measures XLA's placement rather than the hardware's (0.185 for a 448 MiB
all-to-all on two H200s). ``free`` shows what XLA's own schedule does. The barriers are
identities, so both modes compute the same values; the comm-alone and compute-alone
programs are the same in both modes, so ``hidden`` stays comparable between them.

``--bytes`` is the larger buffer of one exchange on one device: the all-to-all's input (=
output; 1/ndev of it stays local), the all-gather's output (its input is ``bytes / ndev``),
the reduce-scatter's input (its output is ``bytes / ndev``). Without ``--matmuls-per-window``
the count is balanced first (``calibrate_matmuls_per_window``): one collective and one matmul
are timed and the count chosen so that compute alone takes about as long as comm alone.

Each program is timed with device synchronisation (``block_until_ready``): two warm-up runs,
then the median of ``--iters`` runs, the three programs taking turns so a drift of the
machine moves them alike. The table reports

    hidden = (comm + compute - both) / min(comm, compute)

1.0: the shorter of the two ran entirely beside the other; 0: they ran one after the other;
negative: running them together was slower than serial (interference). ``comm GB/s`` is
``bytes/exchange * chain / comm`` (algorithm bandwidth per device, not bus bandwidth);
``windows`` is the mode the row's both program ran in.

Every program's output is checked once against a numpy reference computed on the host from
the same random inputs (values in [1, 2), never zero): ``CHECK_COLUMNS`` columns of the
collective chain (collectives move rows, so columns never mix) and the first row of one
device's matmul chain. A mismatch raises ``RuntimeError``.

Settings. ``--xla-option K=V`` goes to ``jit(...).lower(...).compile(compiler_options=...)``
(no options: XLA's defaults). ``--env K=V`` must reach the backend before it starts, which an
in-process run cannot promise, so with ``--env`` the measurement always runs in a fresh
subprocess with the variable in its environment. ``--variant NAME=SPEC`` (repeatable; SPEC a
comma-separated list of ``xla:K=V``, ``env:K=V`` and ``opt:windows=free|pinned``, empty for
the defaults; values cannot hold commas) runs each variant in its own subprocess(es), one
after another, on top of the ``--xla-option`` / ``--env`` / ``--windows`` given outside (the
variant's own win); each child prints its results as JSON lines after
``RESULT_MARKER`` and the parent collects them. The parent never starts a JAX backend (it
would hold the GPUs the children need). A child that fails or runs past
``--variant-timeout`` gets a row saying so and its stderr tail in the log; the parent then
exits non-zero after the table.

``--processes N`` runs one process per local device under ``jax.distributed`` (coordinator on
127.0.0.1, ``local_device_ids=[i]``); the mesh spans every process's devices and process 0
prints. With ``JAX_PLATFORMS=cpu`` the processes use gloo collectives and
``--cpu-devices`` devices each. ``--profile DIR`` traces ``PROFILE_RUNS`` runs of each "both"
program after all timings and, on a GPU, prints the share of NCCL kernel time that ran under
compute kernels (``jtbo.bench.kernel_time``).

Defaults: ``--bytes`` 448 MiB and ``--matmul`` 8192 on an accelerator, 256 KiB and 128 on the
CPU (decided in the measuring process from ``jax.devices()[0].platform``); a default
``--bytes`` is rounded down to a valid multiple, an explicit one must be one.
"""

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jtbo
from jtbo.bench import kernel_time
from jtbo.overlap.xla_options import parse_option

PROBE_AXIS = "x"
"""The mesh axis every probe program runs its collectives over."""
COLUMNS = 512
"""Elements per buffer row: collectives split and join rows, never columns."""
CHECK_COLUMNS = 4
"""Columns of each collective's result compared with the numpy reference."""
WARMUP_RUNS = 2
CALIBRATION_RUNS = 3
"""Timed runs of the one-matmul-per-window program that sets the matmul count."""
MAX_MATMULS_PER_WINDOW = 256
"""More would unroll thousands of matmuls into one program; use a larger ``--matmul``."""
PROFILE_RUNS = 3
RESULT_MARKER = "JTBO_OVERLAP_JSON "
"""Prefix of the JSON lines a child prints for the parent."""
STDERR_TAIL_LINES = 25
ACCELERATOR_DEFAULTS = (448 * 2**20, 8192)  # (--bytes, --matmul)
CPU_DEFAULTS = (256 * 2**10, 128)
TOLERANCE = {"bfloat16": 2**-5, "float32": 2**-7}
"""Max |got - want| allowed, relative to max |want|: bf16 (or TF32) rounding per step, summed
in another order, stays well inside; a misplaced block or a wrong op does not."""
WINDOW_MODES = ("pinned", "free")
"""``--windows``: the both program's windows tied by barriers, or left to XLA (docstring)."""
TABLE_HEADER = (
    "| variant | collective | windows | bytes/exchange | comm ms | compute ms | both ms "
    "| hidden | comm GB/s |\n|---|---|---|---|---|---|---|---|---|"
)
_COMM_STREAM, _Y_STREAM, _W_STREAM = 0, 1, 2  # random streams of the inputs


# --- collectives -------------------------------------------------------------------------


# Each collective is split into its exchange and the elementwise step after it: pinned
# windows put a barrier between the two (see the module docstring).


def _all_to_all_exchange(x: jax.Array) -> jax.Array:
    return jax.lax.all_to_all(x, PROBE_AXIS, 0, 0, tiled=True)


def _all_to_all_finish(received: jax.Array, ndev: int) -> jax.Array:
    del ndev
    # Negation is exact and keeps the values' spread, so a misplaced block always shows.
    return -received


def _all_to_all_reference(x: np.ndarray) -> np.ndarray:
    ndev, rows, k = x.shape
    blocks = x.reshape(ndev, ndev, rows // ndev, k).swapaxes(0, 1)  # [receiver, sender]
    return -blocks.reshape(ndev, rows, k)


def _chunk_weights(ndev: int) -> np.ndarray:
    """Distinct weights 1..ndev: a weighted mean notices chunks in the wrong order."""
    return np.arange(1, ndev + 1, dtype=np.float32)


def _all_gather_exchange(x: jax.Array) -> jax.Array:
    return jax.lax.all_gather(x, PROBE_AXIS, tiled=True)


def _all_gather_finish(received: jax.Array, ndev: int) -> jax.Array:
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


def _psum_scatter_finish(received: jax.Array, ndev: int) -> jax.Array:
    # Back to the input size; dividing by ndev keeps the values in [1, 2).
    return jnp.tile(received, (ndev, 1)) / jnp.asarray(ndev, received.dtype)


def _psum_scatter_reference(x: np.ndarray) -> np.ndarray:
    ndev, rows, k = x.shape
    summed = x.reshape(ndev, ndev, rows // ndev, k).sum(axis=0)  # [receiver]: over senders
    return np.tile(summed, (1, ndev, 1)) / ndev


@dataclasses.dataclass(frozen=True)
class Collective:
    """One probed collective: its chain step inside ``shard_map`` (the exchange, then an
    elementwise finish) and its numpy twin."""

    name: str
    exchange: Callable[[jax.Array], jax.Array]  # x -> what this device received
    finish: Callable[[jax.Array, int], jax.Array]  # (received, ndev) -> next x, x's shape
    reference: Callable[[np.ndarray], np.ndarray]  # (ndev, rows, k) -> the same, on the host
    input_is_shard: bool  # the input is bytes / ndev (all-gather), not bytes

    def step(self, x: jax.Array, ndev: int) -> jax.Array:
        """One link of the collective chain: the exchange and its elementwise finish."""
        return self.finish(self.exchange(x), ndev)


COLLECTIVES = {
    c.name: c
    for c in (
        Collective("all_to_all", _all_to_all_exchange, _all_to_all_finish,
                   _all_to_all_reference, False),
        Collective("all_gather", _all_gather_exchange, _all_gather_finish,
                   _all_gather_reference, True),
        Collective("psum_scatter", _psum_scatter_exchange, _psum_scatter_finish,
                   _psum_scatter_reference, False),
    )
}  # fmt: skip


# --- results -----------------------------------------------------------------------------


def hidden_fraction(comm_s: float, compute_s: float, both_s: float) -> float:
    """How much of the shorter program ran beside the other (see the module docstring).

    Args:
      comm_s: seconds of the collective chain alone.
      compute_s: seconds of the matmul chain alone.
      both_s: seconds of the program running both.

    Returns:
      ``(comm + compute - both) / min(comm, compute)``: 1 fully hidden, 0 serial.

    Raises:
      ValueError: a time that is not positive.
    """
    if min(comm_s, compute_s, both_s) <= 0:
        raise ValueError(f"times must be positive, got {comm_s}, {compute_s}, {both_s}")
    return (comm_s + compute_s - both_s) / min(comm_s, compute_s)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """The timings of one collective under one variant."""

    variant: str
    collective: str
    windows: str  # --windows of the both program (WINDOW_MODES)
    bytes_per_exchange: int  # --bytes: the larger buffer of one exchange on one device
    chain: int  # collectives per program
    matmuls_per_window: int
    comm_s: float  # median seconds of the comm-alone program
    compute_s: float
    both_s: float

    @property
    def hidden(self) -> float:
        return hidden_fraction(self.comm_s, self.compute_s, self.both_s)

    @property
    def comm_gbps(self) -> float:
        return self.bytes_per_exchange * self.chain / self.comm_s / 1e9


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What one measurement ran on and with (the header line)."""

    devices: int
    device_kind: str
    platform: str
    processes: int
    jax_version: str
    bytes_per_exchange: int
    matmul: int
    chain: int
    iters: int
    dtype: str
    windows: str  # --windows of the both programs


@dataclasses.dataclass(frozen=True)
class ProbeSizes:
    """The sizes of one measurement, defaults resolved for the platform."""

    bytes_per_exchange: int
    rows: int  # rows of the --bytes buffer per device (COLUMNS elements each)
    matmul: int
    chain: int
    iters: int
    dtype: str
    matmuls_per_window: int | None  # None: calibrate


# --- variants and settings ---------------------------------------------------------------

OptionValue = str | int | bool | float


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named set of compile options, environment variables and probe options, run in its
    own process."""

    name: str
    xla: tuple[tuple[str, OptionValue], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    windows: str | None = None  # WINDOW_MODES; None: --windows

    def spec(self) -> str:
        """The SPEC that ``parse_variant`` reads back into this variant ("" for defaults)."""
        items = [f"xla:{key}={format_option_value(value)}" for key, value in self.xla]
        items += [f"env:{key}={value}" for key, value in self.env]
        return ",".join(items + ([f"opt:windows={self.windows}"] if self.windows else []))


def format_option_value(value: OptionValue) -> str:
    """Writes a compile option value so that ``parse_option`` reads the same value back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def parse_env(text: str) -> tuple[str, str]:
    """Parses ``KEY=VALUE`` into an environment variable.

    Raises:
      ValueError: no ``=``, or a key that is empty or holds whitespace.
    """
    key, sep, value = text.partition("=")
    if not sep or not key or re.search(r"\s", key):
        raise ValueError(f"environment setting must be KEY=VALUE, got {text!r}")
    return key, value


def parse_probe_option(text: str) -> tuple[str, str]:
    """Parses a variant's ``opt:`` item: ``windows=free`` or ``windows=pinned``.

    Raises:
      ValueError: another key (``windows`` is the only probe option) or mode.
    """
    key, sep, value = text.partition("=")
    if not sep or key != "windows" or value not in WINDOW_MODES:
        raise ValueError(f"probe option must be windows={'|'.join(WINDOW_MODES)}, got {text!r}")
    return key, value


_ITEM_PARSERS = {"xla": parse_option, "env": parse_env, "opt": parse_probe_option}
"""A SPEC item's prefix -> the parser of what follows it."""


def parse_variant(text: str) -> Variant:
    """Parses ``NAME=SPEC`` (SPEC: comma-separated ``xla:K=V`` / ``env:K=V`` /
    ``opt:windows=MODE``, may be empty).

    Args:
      text: e.g. ``"p2p_off=env:NCCL_P2P_DISABLE=1,xla:xla_gpu_use_memcpy_local_p2p=false"``.

    Returns:
      The variant; values cannot hold commas.

    Raises:
      ValueError: no ``=``, a name other than letters, digits and ``_.-``, an item without a
        ``xla:`` / ``env:`` / ``opt:`` prefix or ``=``, an empty item, an unknown probe
        option, or a key given twice.
    """
    name, sep, spec = text.partition("=")
    if not sep or not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"variant must be NAME=SPEC with NAME of [A-Za-z0-9_.-], got {text!r}")
    settings = {kind: {} for kind in _ITEM_PARSERS}
    for item in spec.split(",") if spec else []:
        kind, colon, setting = item.strip().partition(":")
        if not colon or kind not in _ITEM_PARSERS:
            raise ValueError(f"variant {name!r}: item {item!r} must start with xla:, env: or opt:")
        key, value = _ITEM_PARSERS[kind](setting)
        if key in settings[kind]:
            raise ValueError(f"variant {name!r} sets {kind}:{key} twice")
        settings[kind][key] = value
    xla, env, opt = (settings[kind] for kind in ("xla", "env", "opt"))
    return Variant(name, tuple(xla.items()), tuple(env.items()), opt.get("windows"))


def _with_base(variant: Variant, xla: dict, env: dict) -> Variant:
    """The variant on top of the settings given outside it (the variant's own win)."""
    return dataclasses.replace(
        variant, xla=tuple({**xla, **dict(variant.xla)}.items()),
        env=tuple({**env, **dict(variant.env)}.items()),
    )  # fmt: skip


def variants_of(args: argparse.Namespace) -> list[Variant]:
    """The variants a command line asks for, ``--xla-option`` / ``--env`` applied to each.

    Raises:
      ValueError: a malformed ``--variant`` or two variants of one name.
    """
    xla = dict(parse_option(text) for text in args.xla_option)
    env = dict(parse_env(text) for text in args.env)
    given = [parse_variant(text) for text in args.variant] or [Variant("default")]
    names = [variant.name for variant in given]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must differ, got {names}")
    return [_with_base(variant, xla, env) for variant in given]


def _byte_count(text: str) -> int:
    """``65536``, ``64KiB``, ``448MiB`` or ``1GiB`` as a number of bytes."""
    match = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB)?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"bytes must be N, NKiB, NMiB or NGiB, got {text!r}")
    scale = {None: 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[match.group(2)]
    return int(match.group(1)) * scale


def _collective_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in COLLECTIVES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"collectives must be among {list(COLLECTIVES)}")
    return names


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jtbo.bench overlap", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add = parser.add_argument
    add("--collectives", type=_collective_names, default=list(COLLECTIVES),
        help="comma-separated, from " + ",".join(COLLECTIVES))  # fmt: skip
    add("--bytes", type=_byte_count, help="per device and exchange (see above); 448MiB on GPU")
    add("--matmul", type=_positive_int, help="square matmul size N (8192 on GPU, 128 on CPU)")
    add("--chain", type=_positive_int, default=3, help="collectives (windows) per program")
    add("--matmuls-per-window", type=_positive_int, help="default: balanced to the collective")
    add("--iters", type=_positive_int, default=10, help="timed runs per program (median)")
    add("--dtype", choices=tuple(TOLERANCE), default="bfloat16")
    add("--seed", type=int, default=0, help="seed of the random inputs")
    add("--xla-option", action="append", default=[], metavar="K=V", help="compile option")
    add("--env", action="append", default=[], metavar="K=V", help="env var (subprocess)")
    add("--variant", action="append", default=[], metavar="NAME=SPEC",
        help="SPEC: comma-separated xla:K=V / env:K=V / opt:windows=MODE items; one "
             "subprocess each")  # fmt: skip
    add("--windows", choices=WINDOW_MODES, default=WINDOW_MODES[0],
        help="both program: windows tied by barriers (pinned) or left to XLA (free)")  # fmt: skip
    add("--processes", type=_positive_int, default=1, help="one process per local device")
    add("--cpu-devices", type=_positive_int, default=2, help="CPU devices per process")
    add("--variant-timeout", type=float, default=900.0, help="seconds per variant")
    add("--profile", metavar="DIR", help="trace the 'both' programs into DIR")
    # Set by the parent for its children only.
    add("--worker", type=int, help=argparse.SUPPRESS)
    add("--coordinator", help=argparse.SUPPRESS)
    add("--variant-name", default="default", help=argparse.SUPPRESS)
    return parser


# --- sizes and inputs --------------------------------------------------------------------


def buffer_rows(bytes_per_exchange: int, ndev: int, itemsize: int) -> int:
    """Rows of ``COLUMNS`` elements in a ``bytes_per_exchange`` buffer.

    Args:
      bytes_per_exchange: ``--bytes``.
      ndev: devices in the mesh (the buffer is cut into ``ndev`` row blocks).
      itemsize: bytes per element of ``--dtype``.

    Returns:
      The row count, a positive multiple of ``ndev``.

    Raises:
      ValueError: the bytes are not a positive multiple of ``ndev * COLUMNS * itemsize``.
    """
    quantum = ndev * COLUMNS * itemsize
    if bytes_per_exchange <= 0 or bytes_per_exchange % quantum:
        raise ValueError(
            f"--bytes {bytes_per_exchange} must be a positive multiple of {ndev} devices x "
            f"{COLUMNS} columns x {itemsize} bytes per element = {quantum}"
        )
    return bytes_per_exchange // (COLUMNS * itemsize)


def resolve_sizes(args: argparse.Namespace, platform: str, ndev: int) -> ProbeSizes:
    """The sizes of a measurement, unset ones from the platform's defaults.

    Raises:
      ValueError: ``--bytes`` not a valid multiple (``buffer_rows``).
    """
    default_bytes, default_matmul = CPU_DEFAULTS if platform == "cpu" else ACCELERATOR_DEFAULTS
    itemsize = jnp.dtype(args.dtype).itemsize
    quantum = ndev * COLUMNS * itemsize
    size = args.bytes if args.bytes is not None else max(default_bytes // quantum, 1) * quantum
    return ProbeSizes(
        bytes_per_exchange=size, rows=buffer_rows(size, ndev, itemsize),
        matmul=args.matmul or default_matmul, chain=args.chain, iters=args.iters,
        dtype=args.dtype, matmuls_per_window=args.matmuls_per_window,
    )  # fmt: skip


def device_block(
    seed: int, stream: int, position: int, shape: tuple[int, int], dtype
) -> np.ndarray:
    """The random input block of mesh position ``position``, values in [1, 2).

    Generated column by column, so ``device_block(..., (rows, k), ...)`` equals the first
    ``k`` columns of any wider block: the reference regenerates only what it checks.
    """
    rows, columns = shape
    block = np.random.default_rng([seed, stream, position]).random((columns, rows), np.float32)
    block += 1
    # Cast before transposing: the strided copy then moves 2-byte elements (2x faster).
    return np.ascontiguousarray(block.astype(dtype).T)


def _position(index: tuple[slice, ...], rows: int) -> int:
    """Mesh position of the device holding global rows ``index[0]`` (``rows`` per device)."""
    return (index[0].start or 0) // rows


def _sharded_input(mesh, rows: int, columns: int, make_block) -> jax.Array:
    """A ``(ndev * rows, columns)`` array, block ``p`` = ``make_block(p)`` on position ``p``;
    built per local device, so it works across processes."""
    sharding = NamedSharding(mesh, P(PROBE_AXIS))
    return jax.make_array_from_callback(
        (mesh.size * rows, columns), sharding, lambda index: make_block(_position(index, rows))
    )


def _comm_input_rows(collective: Collective, sizes: ProbeSizes, ndev: int) -> int:
    return sizes.rows // ndev if collective.input_is_shard else sizes.rows


def _matmul_block(seed: int, stream: int, position: int, n: int, dtype) -> np.ndarray:
    """``y`` (``_Y_STREAM``, in [-1, 1)) or ``w`` (``_W_STREAM``) of one device. ``w`` has
    mean 0 and variance 1/n, so its spectral radius is about 1 and the chain (a power
    iteration) grows slowly: about 2e5 x over 320 matmuls at n = 256, less at larger n; an
    overflow would show as a failed check, not a wrong pass."""
    block = np.random.default_rng([seed, stream, position]).random((n, n), np.float32)
    shift, scale = (0.5, 2.0) if stream == _Y_STREAM else (0.5, math.sqrt(12 / n))
    block -= shift  # in place: a 8192 x 8192 block is 256 MiB in float32
    block *= scale
    return block.astype(dtype)


def _matmul_inputs(mesh, sizes: ProbeSizes, seed: int) -> tuple[jax.Array, jax.Array]:
    dtype, n = jnp.dtype(sizes.dtype), sizes.matmul
    return tuple(
        _sharded_input(mesh, n, n, lambda p, s=stream: _matmul_block(seed, s, p, n, dtype))
        for stream in (_Y_STREAM, _W_STREAM)
    )


# --- references and checks ---------------------------------------------------------------


def _rounded(x: np.ndarray, dtype) -> np.ndarray:
    """``x`` rounded to ``dtype`` as the device stores it, back in float32."""
    return np.asarray(x, dtype=dtype).astype(np.float32)


def comm_reference(collective: Collective, x: np.ndarray, chain: int, dtype) -> np.ndarray:
    """The collective chain on the host.

    Args:
      collective: the probed collective.
      x: ``(ndev, rows, k)`` inputs, some leading columns of each device's block.
      chain: collectives in the chain.
      dtype: the device dtype (each step's result is rounded to it).

    Returns:
      ``(ndev, rows, k)`` float32: what each device should hold after the chain.
    """
    x = x.astype(np.float32)
    for _ in range(chain):
        x = _rounded(collective.reference(x), dtype)
    return x


def matmul_reference(y_row: np.ndarray, w: np.ndarray, steps: int, dtype) -> np.ndarray:
    """Row 0 of ``y @ w @ w ...`` (``steps`` matmuls), rounded to ``dtype`` after each."""
    row, w = y_row.astype(np.float32), w.astype(np.float32)
    for _ in range(steps):
        row = _rounded(row @ w, dtype)
    return row


def check_close(what: str, got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    """Checks a program's output against its reference.

    Args:
      what: names the program and output in the error.
      got: the device's values.
      want: the reference, same shape.
      dtype: ``--dtype``, which sets the tolerance (``TOLERANCE``).

    Raises:
      RuntimeError: shapes differ, or ``max |got - want| > TOLERANCE * max |want|`` (or NaN).
    """
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got.shape != want.shape:
        raise RuntimeError(f"{what}: shape {got.shape}, the reference's {want.shape}")
    error, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
    if not error <= TOLERANCE[dtype] * scale:
        raise RuntimeError(
            f"{what}: max |got - want| = {error:.4g} exceeds {TOLERANCE[dtype]} x max |want| "
            f"({scale:.4g}); the program does not compute its numpy reference"
        )


def _local_columns(array: jax.Array, rows: int, k: int) -> dict[int, np.ndarray]:
    """Mesh position -> first ``k`` columns of that device's block, for this process's
    devices (another process checks its own)."""
    return {
        _position(shard.index, rows): np.asarray(shard.data[:, :k])
        for shard in array.addressable_shards
    }


def _check_comm(what: str, out: jax.Array, want: np.ndarray, dtype: str) -> None:
    for position, got in _local_columns(out, want.shape[1], want.shape[2]).items():
        check_close(f"{what} (device {position})", got, want[position], dtype)


@dataclasses.dataclass(frozen=True)
class MatmulCheck:
    """Host copies of the matmul inputs of the one device whose first row is checked."""

    position: int
    y_row: np.ndarray  # row 0 of y, as the device holds it
    w: np.ndarray  # float32 of the device's w


def _matmul_check(y: jax.Array, sizes: ProbeSizes, seed: int) -> MatmulCheck:
    """Made once per measurement: every collective's matmul chain starts from them."""
    dtype, n = jnp.dtype(sizes.dtype), sizes.matmul
    position = _position(y.addressable_shards[0].index, n)
    y_row = _matmul_block(seed, _Y_STREAM, position, n, dtype)[0]
    w = _matmul_block(seed, _W_STREAM, position, n, dtype).astype(np.float32)
    return MatmulCheck(position, y_row, w)


@dataclasses.dataclass(frozen=True)
class Expected:
    """The references one collective's three programs are checked against."""

    comm: np.ndarray  # (ndev, rows, CHECK_COLUMNS)
    matmul_position: int  # the device whose first matmul row is checked
    matmul_row: np.ndarray


def _expected(collective, sizes, ndev: int, seed: int, matmuls: int, check: MatmulCheck):
    """The ``Expected`` outputs of one collective's programs (``matmuls`` per window)."""
    dtype, rows = jnp.dtype(sizes.dtype), _comm_input_rows(collective, sizes, ndev)
    columns = np.stack([
        device_block(seed, _COMM_STREAM, p, (rows, CHECK_COLUMNS), dtype) for p in range(ndev)
    ])  # fmt: skip
    row = matmul_reference(check.y_row, check.w, sizes.chain * matmuls, dtype)
    return Expected(comm_reference(collective, columns, sizes.chain, dtype), check.position, row)


def _check_matmul(what: str, out: jax.Array, expected: Expected, sizes: ProbeSizes) -> None:
    shard = next(s for s in out.addressable_shards
                 if _position(s.index, sizes.matmul) == expected.matmul_position)  # fmt: skip
    got = np.asarray(shard.data[0])
    check_close(f"{what} (device {expected.matmul_position}, row 0)", got,
                expected.matmul_row, sizes.dtype)  # fmt: skip


def _check_programs(name: str, outputs: dict, expected: Expected, sizes: ProbeSizes) -> None:
    """Checks the comm, compute and both programs' outputs once (``Expected``).

    Raises:
      RuntimeError: an output differs from its reference.
    """
    both_comm, both_compute = outputs["both"]
    _check_comm(f"{name}: comm alone", outputs["comm"], expected.comm, sizes.dtype)
    _check_comm(f"{name}: both, collective chain", both_comm, expected.comm, sizes.dtype)
    _check_matmul(f"{name}: compute alone", outputs["compute"], expected, sizes)
    _check_matmul(f"{name}: both, matmul chain", both_compute, expected, sizes)


# --- programs, timing, calibration -------------------------------------------------------


def _comm_chain(x: jax.Array, collective: Collective, chain: int, ndev: int) -> jax.Array:
    for _ in range(chain):
        x = collective.step(x, ndev)
    return x


def _matmul_chain(y: jax.Array, w: jax.Array, count: int) -> jax.Array:
    for _ in range(count):
        y = y @ w
    return y


def _free_windows(x, y, w, collective: Collective, chain: int, matmuls: int, ndev: int):
    """Both chains as independent dataflow: XLA's scheduler alone decides what overlaps."""
    return _comm_chain(x, collective, chain, ndev), _matmul_chain(y, w, chain * matmuls)


def _pinned_windows(x, y, w, collective: Collective, chain: int, matmuls: int, ndev: int):
    """Both chains, window k of the collective chain pinned beside window k of the matmul
    chain by barriers (see the module docstring); the same values as ``_free_windows``.

    Returns:
      ``(x, y)`` after ``chain`` windows of one collective and ``matmuls`` matmuls each.
    """
    for _ in range(chain):
        # Collective k cannot start before window k's matmul input is ready, nor its
        # matmuls before collective k's input is: the two are issued together.
        x, y = jax.lax.optimization_barrier((x, y))
        received, y = jax.lax.optimization_barrier(
            (collective.exchange(x), _matmul_chain(y, w, matmuls))
        )
        # Past the barrier: collective k is done before window k + 1's matmuls (which read
        # y) start, and its finish waits for window k's matmuls, so one block per window.
        x = collective.finish(received, ndev)
    return x, y


BOTH_BODIES = {"pinned": _pinned_windows, "free": _free_windows}
"""``--windows`` -> the both program's body, ``(x, y, w, collective, chain, matmuls, ndev)
-> (x, y)``."""


def _compile(body, mesh, inputs: Sequence[jax.Array], outputs: int, options: dict):
    """``body`` as one ``shard_map`` over the mesh, jitted and compiled with ``options``."""
    spec = P(PROBE_AXIS)
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(spec,) * len(inputs),
        out_specs=spec if outputs == 1 else (spec,) * outputs, check_vma=False,
    )  # fmt: skip
    return jax.jit(mapped).lower(*inputs).compile(compiler_options=options)


def _programs(
    collective, mesh, chain: int, matmuls: int, inputs, options, names, windows: str = "free"
) -> dict:
    """Zero-argument runs of the named programs among comm, compute and both, compiled with
    ``options`` (``inputs``: x, y, w); ``windows`` (``WINDOW_MODES``) shapes only both."""
    x, y, w = inputs

    def comm(x):
        return _comm_chain(x, collective, chain, mesh.size)

    def compute(y, w):
        return _matmul_chain(y, w, chain * matmuls)

    def both(x, y, w):
        return BOTH_BODIES[windows](x, y, w, collective, chain, matmuls, mesh.size)

    bodies = {"comm": (comm, (x,), 1), "compute": (compute, (y, w), 1), "both": (both, inputs, 2)}
    runs = {}
    for name in names:
        body, args, outputs = bodies[name]
        compiled = _compile(body, mesh, args, outputs, options)
        runs[name] = lambda compiled=compiled, args=args: compiled(*args)
    return runs


def median_seconds(runs: Sequence[Callable[[], object]], iters: int) -> list[float]:
    """Median seconds of each run, device-synchronised.

    Args:
      runs: zero-argument callables returning jax arrays.
      iters: timed runs of each, after ``WARMUP_RUNS``; the runs take turns.

    Returns:
      One median per run, in order.
    """
    for run in runs:
        for _ in range(WARMUP_RUNS):
            jax.block_until_ready(run())
    times = [[] for _ in runs]
    for _ in range(iters):
        for column, run in zip(times, runs, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(run())
            column.append(time.perf_counter() - start)
    return [statistics.median(column) for column in times]


def balanced_matmuls_per_window(comm_s: float, matmul_s: float) -> int:
    """Matmuls that take about as long as one collective.

    Args:
      comm_s: seconds of one collective (with its elementwise step).
      matmul_s: seconds of one matmul.

    Returns:
      ``round(comm_s / matmul_s)``, at least 1.

    Raises:
      ValueError: a time that is not positive, or more than ``MAX_MATMULS_PER_WINDOW``.
    """
    if comm_s <= 0 or matmul_s <= 0:
        raise ValueError(f"times must be positive, got {comm_s}, {matmul_s}")
    count = max(1, round(comm_s / matmul_s))
    if count > MAX_MATMULS_PER_WINDOW:
        raise ValueError(
            f"{count} matmuls per window (collective {comm_s * 1e3:.3f} ms, matmul "
            f"{matmul_s * 1e3:.3f} ms) exceeds {MAX_MATMULS_PER_WINDOW}: raise --matmul or "
            "set --matmuls-per-window"
        )
    return count


def _same_on_every_process(count: int) -> int:
    """Process 0's count everywhere: every process must compile the same programs."""
    if jax.process_count() == 1:
        return count
    from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process only

    return int(multihost_utils.broadcast_one_to_all(np.int32(count)))


def calibrate_matmuls_per_window(run_comm, collective, mesh, sizes, inputs, options) -> int:
    """Balances the matmul count to the collective (``balanced_matmuls_per_window``).

    Args:
      run_comm: runs the comm-alone program (``--chain`` collectives).
      collective, mesh, sizes, inputs, options: as for ``probe_collective``.

    Returns:
      Process 0's count, on every process (they must compile the same programs).
    """
    run_compute = _programs(collective, mesh, sizes.chain, 1, inputs, options, ["compute"])
    comm_s, compute_s = median_seconds([run_comm, run_compute["compute"]], CALIBRATION_RUNS)
    return _same_on_every_process(balanced_matmuls_per_window(comm_s, compute_s))


# --- one measurement ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProbeInputs:
    """The random inputs of one measurement, shared by its collectives."""

    comm: dict[int, jax.Array]  # rows per device -> the collective chain's input
    y: jax.Array
    w: jax.Array
    matmul_check: MatmulCheck
    seed: int


def make_inputs(mesh, sizes: ProbeSizes, names: Sequence[str], seed: int) -> ProbeInputs:
    """Builds every input once: collectives of one input size share it (host generation of
    a 448 MiB block takes seconds)."""
    dtype = jnp.dtype(sizes.dtype)
    comm = {}
    for rows in {_comm_input_rows(COLLECTIVES[name], sizes, mesh.size) for name in names}:
        comm[rows] = _sharded_input(mesh, rows, COLUMNS, lambda p, rows=rows: device_block(
            seed, _COMM_STREAM, p, (rows, COLUMNS), dtype))  # fmt: skip
    y, w = _matmul_inputs(mesh, sizes, seed)
    return ProbeInputs(comm, y, w, _matmul_check(y, sizes, seed), seed)


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
      ``(ProbeResult, run_both)``: ``run_both`` runs the both program again (for profiling).

    Raises:
      RuntimeError: an output differs from its numpy reference.
    """
    x = probe_inputs.comm[_comm_input_rows(collective, sizes, mesh.size)]
    inputs = (x, probe_inputs.y, probe_inputs.w)
    runs = _programs(collective, mesh, sizes.chain, 0, inputs, options, ["comm"])
    matmuls = sizes.matmuls_per_window or calibrate_matmuls_per_window(
        runs["comm"], collective, mesh, sizes, inputs, options
    )
    runs |= _programs(
        collective, mesh, sizes.chain, matmuls, inputs, options, ["compute", "both"], windows
    )
    expected = _expected(
        collective, sizes, mesh.size, probe_inputs.seed, matmuls, probe_inputs.matmul_check
    )
    _check_programs(collective.name, {k: run() for k, run in runs.items()}, expected, sizes)
    times = median_seconds([runs["comm"], runs["compute"], runs["both"]], sizes.iters)
    result = ProbeResult(
        variant, collective.name, windows, sizes.bytes_per_exchange, sizes.chain, matmuls, *times
    )
    return result, runs["both"]


def _latest_trace(folder: str) -> str:
    traces = sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))
    if not traces:
        raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {folder}")
    return traces[-1]  # a reused folder holds older runs under earlier timestamps


def profile_both(run_both: Callable[[], object], directory: str, label: str) -> list[str]:
    """Traces ``PROFILE_RUNS`` runs of a both program into ``directory/label/process_I``.

    Returns:
      Lines to print: on a GPU the NCCL time under compute kernels and the busy times
      (``jtbo.bench.kernel_time``), elsewhere where the trace went.
    """
    folder = os.path.join(directory, label, f"process_{jax.process_index()}")
    jax.block_until_ready(run_both())
    with jax.profiler.trace(folder):
        for _ in range(PROFILE_RUNS):
            jax.block_until_ready(run_both())
    if jax.devices()[0].platform != "gpu":
        return [f"{label}: traces written to {folder} (NCCL attribution needs a GPU trace)"]
    return nccl_lines(kernel_time.read_trace(_latest_trace(folder)), label)


def nccl_lines(trace: dict, label: str) -> list[str]:
    """What a GPU trace of ``PROFILE_RUNS`` both-program runs says about overlap.

    Args:
      trace: the parsed trace (``kernel_time.read_trace``), holding only those runs (the
        warm-up ran before it), so every kernel counts: NCCL kernels need not carry the
        module's name.
      label: the line prefix.

    Returns:
      The share of NCCL kernel time that ran under compute kernels
      (``kernel_time.communication_summary``) and the busy times per run.
    """
    kernels = kernel_time.gpu_kernels(trace)
    return [
        f"{label}: {kernel_time.communication_summary(kernels)}",
        f"{label}: {kernel_time.busy_summary(kernels, PROFILE_RUNS)}",
    ]


def _run_info(sizes: ProbeSizes, windows: str) -> RunInfo:
    device = jax.devices()[0]
    return RunInfo(
        len(jax.devices()), device.device_kind, device.platform, jax.process_count(),
        jax.__version__, sizes.bytes_per_exchange, sizes.matmul, sizes.chain, sizes.iters,
        sizes.dtype, windows,
    )  # fmt: skip


def measure(args: argparse.Namespace, variant: str, emit: Callable[[str, object], None]) -> None:
    """Probes every ``--collectives`` entry in this process (and its ``jax.distributed``
    peers), calling ``emit("info", RunInfo)`` once and ``emit("result", ProbeResult)`` per
    collective on process 0.

    Raises:
      RuntimeError: a program's output differs from its numpy reference.
      ValueError: bad ``--bytes`` or an unbalanceable matmul count.
    """
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), (PROBE_AXIS,), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))  # fmt: skip
    sizes = resolve_sizes(args, devices[0].platform, len(devices))
    leader = jax.process_index() == 0
    if leader:
        emit("info", _run_info(sizes, args.windows))
    options = dict(parse_option(text) for text in args.xla_option)
    probe_inputs = make_inputs(mesh, sizes, args.collectives, args.seed)
    to_profile = []
    for name in args.collectives:
        result, run_both = probe_collective(
            COLLECTIVES[name], mesh, sizes, options, probe_inputs, variant, args.windows
        )
        if leader:
            emit("result", result)
        to_profile.append((f"{variant}_{name}", run_both))
    # Traces come after every timing: the profiler's hooks may slow later runs.
    for label, run_both in to_profile if args.profile else []:
        lines = profile_both(run_both, args.profile, label)
        if leader:
            print("\n".join(lines), flush=True)


# --- the table ---------------------------------------------------------------------------


def _format_bytes(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def result_row(result: ProbeResult) -> str:
    """One table row."""
    return (
        f"| {result.variant} | {result.collective} | {result.windows} "
        f"| {_format_bytes(result.bytes_per_exchange)} "
        f"| {result.comm_s * 1e3:.3f} | {result.compute_s * 1e3:.3f} | {result.both_s * 1e3:.3f} "
        f"| {result.hidden:.3f} | {result.comm_gbps:.2f} |"
    )


def _progress_line(result: ProbeResult) -> str:
    return (
        f"{result.collective}: {result.matmuls_per_window} matmuls/window, {result.windows} "
        f"windows; comm "
        f"{result.comm_s * 1e3:.3f} ms, compute {result.compute_s * 1e3:.3f} ms, both "
        f"{result.both_s * 1e3:.3f} ms, hidden {result.hidden:.3f}"
    )


def header_line(variant: Variant, info: RunInfo | None, results: Sequence[ProbeResult]) -> str:
    """The header line of a variant: its settings and what it ran on."""
    settings = variant.spec() or "defaults"
    if info is None:
        return f"variant {variant.name} ({settings}): no run information (it failed first)"
    counts = ", ".join(f"{r.collective} {r.matmuls_per_window}" for r in results)
    return (
        f"variant {variant.name} ({settings}): {info.devices} x {info.device_kind} "
        f"({info.platform}), {info.processes} process(es), jax {info.jax_version}; "
        f"bytes/exchange {_format_bytes(info.bytes_per_exchange)}, matmul {info.matmul}, "
        f"chain {info.chain}, iters {info.iters}, {info.dtype}, windows {info.windows}; "
        f"matmuls/window: {counts}"
    )


@dataclasses.dataclass(frozen=True)
class VariantOutcome:
    """What a variant's run brought back."""

    variant: Variant
    info: RunInfo | None
    results: tuple[ProbeResult, ...]
    failure: str | None = None  # what went wrong, None if the run succeeded
    stderr_tail: str = ""


def _failure_row(outcome: VariantOutcome) -> str:
    last = outcome.stderr_tail.strip().splitlines()[-1:] or [""]
    cell = f"FAILED: {outcome.failure}: {last[0][:160]}".replace("|", "/")
    return f"| {outcome.variant.name} | {cell} | - | - | - | - | - | - | - |"


def print_report(outcomes: Sequence[VariantOutcome]) -> None:
    """Header lines, failures' stderr tails, then the table (last)."""
    for outcome in outcomes:
        print(header_line(outcome.variant, outcome.info, outcome.results))
    for outcome in outcomes:
        if outcome.failure:
            print(f"\nvariant {outcome.variant.name} failed ({outcome.failure}); stderr tail:")
            print(outcome.stderr_tail)
    print(TABLE_HEADER)
    for outcome in outcomes:
        for result in outcome.results:
            print(result_row(result))
        if outcome.failure:
            print(_failure_row(outcome))


# --- processes ---------------------------------------------------------------------------


def _emit_json(kind: str, payload: object) -> None:
    if kind == "result":
        print(_progress_line(payload), flush=True)
    record = {"kind": kind, **dataclasses.asdict(payload)}
    print(RESULT_MARKER + json.dumps(record), flush=True)


def _join_distributed(args: argparse.Namespace) -> None:
    """Joins the ``jax.distributed`` run as process ``--worker`` (before any backend use)."""
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        # Cross-process CPU collectives need gloo; jax_num_cpu_devices wins over XLA_FLAGS.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    jax.distributed.initialize(
        coordinator_address=args.coordinator, num_processes=args.processes,
        process_id=args.worker, local_device_ids=[args.worker],
    )  # fmt: skip


def _worker_main(args: argparse.Namespace) -> None:
    """A child's run: the measurement, results as ``RESULT_MARKER`` JSON lines."""
    if args.processes > 1:
        _join_distributed(args)
    measure(args, args.variant_name, _emit_json)
    if args.processes > 1:
        jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_argv(args: argparse.Namespace, variant: Variant, process_id: int, port: int) -> list:
    """The command line of one child of ``variant`` (the measurement flags, its options;
    its ``opt:windows`` wins over ``--windows``)."""
    argv = [sys.executable, "-m", "jtbo.bench", "overlap", "--worker", str(process_id),
            "--coordinator", f"127.0.0.1:{port}", "--variant-name", variant.name,
            "--processes", str(args.processes), "--cpu-devices", str(args.cpu_devices),
            "--collectives", ",".join(args.collectives), "--chain", str(args.chain),
            "--iters", str(args.iters), "--dtype", args.dtype, "--seed", str(args.seed),
            "--windows", variant.windows or args.windows]  # fmt: skip
    optional = {"--bytes": args.bytes, "--matmul": args.matmul,
                "--matmuls-per-window": args.matmuls_per_window,
                "--profile": args.profile and os.path.abspath(args.profile)}  # fmt: skip
    argv += [item for flag, value in optional.items() if value for item in (flag, str(value))]
    for key, value in variant.xla:
        argv += ["--xla-option", f"{key}={format_option_value(value)}"]
    return argv


def _worker_env(variant: Variant) -> dict[str, str]:
    """The parent's environment, the variant's variables, and this jtbo importable."""
    package_root = str(Path(jtbo.__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, **dict(variant.env), "PYTHONPATH": path}


class _LogRelay:
    """Prints the lines a child adds to its stdout file, without the JSON ones."""

    def __init__(self, path: Path, prefix: str):
        self.path, self.prefix, self.offset = path, prefix, 0

    def relay(self) -> None:
        text = self.path.read_text(errors="replace")
        end = text.rfind("\n") + 1  # only whole lines
        for line in text[self.offset : end].splitlines():
            if not line.startswith(RESULT_MARKER):
                print(f"{self.prefix}{line}", flush=True)
        self.offset = max(self.offset, end)


def _start_workers(args, variant: Variant, folder: Path) -> list[subprocess.Popen]:
    port, procs = _free_port(), []
    for process_id in range(args.processes):
        out, err = folder / f"out{process_id}.txt", folder / f"err{process_id}.txt"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            procs.append(subprocess.Popen(
                worker_argv(args, variant, process_id, port), env=_worker_env(variant),
                stdout=stdout, stderr=stderr,
            ))  # fmt: skip
    return procs


def _wait_workers(procs, relay: _LogRelay, timeout_s: float) -> str | None:
    """Waits for every child; kills the rest once one fails or time runs out.

    Returns:
      None if all exited 0, else what went wrong.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        relay.relay()
        codes = [proc.poll() for proc in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if None not in codes and not failed:
            return None
        if failed or time.monotonic() > deadline:
            for proc in procs:
                proc.kill()  # a no-op for one that has exited
                proc.wait()
            relay.relay()
            what = ", ".join(f"process {i} exit code {c}" for i, c in failed)
            return what or f"ran past --variant-timeout {timeout_s:g} s"
        time.sleep(0.2)


def _records(stdout: str) -> list[dict]:
    """The JSON records among a child's stdout lines."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    return [json.loads(line[len(RESULT_MARKER) :]) for line in lines]


def _tail(paths: Sequence[Path]) -> str:
    lines = []
    for path in paths:
        text = path.read_text(errors="replace").splitlines()[-STDERR_TAIL_LINES:]
        lines += [f"[{path.stem}] {line}" for line in text]
    return "\n".join(lines)


def _outcome(variant, failure, records, collectives, stderr_paths) -> VariantOutcome:
    """A variant's outcome from its records; missing collectives count as a failure."""
    infos = [RunInfo(**{k: v for k, v in r.items() if k != "kind"}) for r in records
             if r["kind"] == "info"]  # fmt: skip
    results = tuple(ProbeResult(**{k: v for k, v in r.items() if k != "kind"})
                    for r in records if r["kind"] == "result")  # fmt: skip
    missing = [name for name in collectives if name not in {r.collective for r in results}]
    if failure is None and missing:
        failure = f"no result for {', '.join(missing)}"
    tail = _tail(stderr_paths) if failure else ""
    return VariantOutcome(variant, infos[0] if infos else None, results, failure, tail)


def run_variant(args: argparse.Namespace, variant: Variant) -> VariantOutcome:
    """Runs one variant in fresh child process(es) and collects what they report.

    Returns:
      The outcome; a failing or hanging child gives a ``failure`` and its stderr tail.
    """
    with tempfile.TemporaryDirectory(prefix="jtbo_overlap_") as name:
        folder = Path(name)
        print(f"[{variant.name}] starting: {variant.spec() or 'defaults'}", flush=True)
        procs = _start_workers(args, variant, folder)
        relay = _LogRelay(folder / "out0.txt", f"[{variant.name}] ")
        failure = _wait_workers(procs, relay, args.variant_timeout)
        records = _records((folder / "out0.txt").read_text(errors="replace"))
        stderr_paths = [folder / f"err{i}.txt" for i in range(args.processes)]
        return _outcome(variant, failure, records, args.collectives, stderr_paths)


def _in_process(args: argparse.Namespace, variant: Variant) -> VariantOutcome:
    """Measures here, in this process's JAX backend (no --env, --variant or --processes)."""
    collected = {"info": [], "result": []}

    def emit(kind: str, payload: object) -> None:
        if kind == "result":
            print(_progress_line(payload), flush=True)
        collected[kind].append(payload)

    measure(args, variant.name, emit)
    return VariantOutcome(variant, collected["info"][0], tuple(collected["result"]))


def main(argv: list[str]) -> None:
    """Runs the probe (see the module docstring).

    Raises:
      ValueError: malformed settings or sizes.
      RuntimeError: an in-process program computes something else than its reference.
      SystemExit: a variant's child process failed (after the table is printed).
    """
    args = _parser().parse_args(argv)
    if args.worker is not None:
        _worker_main(args)
        return
    variants = variants_of(args)
    if not args.variant and not args.env and args.processes == 1:
        print_report([_in_process(args, variants[0])])
        return
    outcomes = [run_variant(args, variant) for variant in variants]
    print_report(outcomes)
    failed = [outcome.variant.name for outcome in outcomes if outcome.failure]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(outcomes)} variant(s) failed: {failed}")
