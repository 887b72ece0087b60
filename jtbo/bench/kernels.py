"""Bandwidth of the jtbo.kernels ops against the device's copy ceiling.

``python -m jtbo.bench kernels [--sizes-mib 1,16,256,1024] [--cols 4096]
[--dtype bfloat16] [--impls xla,pallas,triton] [--sweep-mib 256] [--iters N] [--out FILE]``

Each op moves ``S`` bytes of payload (``S`` = the size): ``dp_memcpy`` copies S bytes
into / out of a buffer at a row offset; ``slice_pad`` copies 15/16 of a child of S
bytes and zero-fills the rest; ``merge_rows`` writes two children covering S bytes.
GB/s counts bytes read plus bytes written. The ceiling is measured in the same run
on a plain device-to-device copy of the same bytes: ``torch.Tensor.copy_`` when
torch imports (used only as this yardstick), else the best of XLA's own copies; the
table names which.

Timing: one jitted program holds ``unroll`` calls of the op written out one after
another (no loop, so no per-iteration loop control or offset arithmetic runs on the
device between calls); every call gets its own scalar *arguments* (so XLA can
neither fold nor merge calls) and every output is returned (so none is dead). The
program is enqueued ``runs`` times back to back and waited for once; the per-call
time is the median over ``--reps`` such batches. Set-up is cheap: each size's input
buffers are filled once by one jitted integer hash and shared by every op, impl and
config, and the buffers are arguments, never constants baked into the program.
``--sweep-mib`` also times ``SWEEP_CONFIGS`` for the kernel impls at one size and
ends with a summary: the best config per op and impl and its fraction of the ceiling.
"""

import argparse
import dataclasses
import datetime
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import kernels
from jtbo.core import cli_arguments
from jtbo.kernels import copy_config
from jtbo.kernels import impls as impls_lib

MIB = 1 << 20
GIB = 1 << 30
# (block_elems, num_warps, eviction_policy): the neighbourhood of the defaults that
# matters on the H200 (vectors per thread 1..8, 8..32 warps, one cache hint).
SWEEP_CONFIGS = (
    (4096, 16, None),
    (8192, 16, None),
    (16384, 8, None),
    (16384, 16, None),
    (32768, 16, None),
    (32768, 32, None),
    (16384, 16, "evict_first"),
)
OPS = ("dp_memcpy(dst@off)", "dp_memcpy(src@off)", "slice_pad", "merge_rows")
SWEEP_OPS = "dp_memcpy(dst@off),slice_pad,merge_rows"
TARGET_BYTES_PER_REP = 64 * GIB  # ~15 ms of traffic at H200 speed: launch gaps vanish


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Inputs of every op at one payload size, filled once.

    Attributes:
      rows: payload rows.
      big: ``[2 * rows, cols]`` the offset-side buffer (source of slices, memcpy side).
      small: ``[rows, cols]`` the plain-side buffer.
      part_a: ``[rows // 2 + rows // 16, cols]`` first TBO child.
      part_b: ``[rows // 2 + rows // 16, cols]`` second TBO child.
    """

    rows: int
    big: jax.Array  # [2 * rows, cols]
    small: jax.Array  # [rows, cols]
    part_a: jax.Array  # [rows // 2 + rows // 16, cols]
    part_b: jax.Array  # [rows // 2 + rows // 16, cols]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _fill(rows, cols, dtype, seed):
    # A multiplicative integer hash of the element index: non-zero, varied, and one
    # fused kernel (jax.random on GiB buffers is far slower to compile and run).
    i = jax.lax.iota(jnp.uint32, rows * cols) + jnp.uint32(seed * 0x9E3779B9 & 0xFFFFFFFF)
    h = (i * jnp.uint32(2654435761)) >> 20
    return ((h & 1023).astype(jnp.float32) / 128 + 1).astype(dtype).reshape(rows, cols)


def make_buffers(size_bytes, cols, dtype):
    """The shared inputs for a payload of ``size_bytes`` (rows of ``cols`` elements)."""
    rows = max(size_bytes // (cols * jnp.dtype(dtype).itemsize), 16)
    part_rows = rows // 2 + rows // 16
    bufs = Buffers(
        rows=rows,
        big=_fill(2 * rows, cols, dtype, 1),
        small=_fill(rows, cols, dtype, 2),
        part_a=_fill(part_rows, cols, dtype, 3),
        part_b=_fill(part_rows, cols, dtype, 4),
    )
    return jax.block_until_ready(bufs)


def _scalars(values):
    return tuple(jnp.asarray(v, jnp.int32) for v in values)


def _memcpy_program(bufs, impl, cfg, unroll, offset_src):
    rows = bufs.rows
    dst, src = (bufs.small, bufs.big) if offset_src else (bufs.big, bufs.small)

    def run(dst, src, offsets):
        for off in offsets:  # one call per offset argument, in sequence on the aliased dst
            dst = kernels.dp_memcpy(
                dst, src, off, rows, offset_src=offset_src, impl=impl, config=cfg
            )
        return dst

    offsets = _scalars(rows // 3 + k % 2 for k in range(unroll))
    return jax.jit(run, donate_argnums=0), (jnp.copy(dst), src, offsets), True


def _after(outs):
    """A zero that depends on the previous call's output (0 for the first call).

    Without it XLA fuses the unrolled xla-impl calls into one multi-output fusion that reads
    the shared input once for all of them, and the xla rows report more than the copy
    ceiling; the dependency keeps every call a separate pass over memory, as in a real step.
    """
    if not outs:
        return jnp.int32(0)
    return (outs[-1][0, 0].astype(jnp.float32) * 0.0).astype(jnp.int32)


def _slice_pad_program(bufs, impl, cfg, unroll):
    rows = bufs.rows
    length = rows - rows // 16

    def run(x, starts):
        outs = []
        for start in starts:
            start = start + _after(outs)
            outs.append(kernels.slice_pad(x, start, length, capacity=rows, impl=impl, config=cfg))
        return tuple(outs)

    starts = _scalars(rows // 3 + k % 2 for k in range(unroll))
    return jax.jit(run), (bufs.big, starts), False


def _merge_program(bufs, impl, cfg, unroll):
    rows = bufs.rows

    def run(a, b, splits, rests):
        outs = []
        for split, rest in zip(splits, rests, strict=True):
            split = split + _after(outs)
            parts = ([a, b], [0, split], [split, rest])
            outs.append(kernels.merge_rows(*parts, out_len=rows, impl=impl, config=cfg))
        return tuple(outs)

    splits = [rows // 2 - k % 2 for k in range(unroll)]
    args = (bufs.part_a, bufs.part_b, _scalars(splits), _scalars(rows - s for s in splits))
    return jax.jit(run), args, False


def program(op, bufs, impl, cfg, unroll):
    """``(jitted fn, args, chained)`` running ``unroll`` calls of ``op``.

    ``chained``: the first argument is donated and the result replaces it next run.
    """
    if op == "dp_memcpy(dst@off)":
        return _memcpy_program(bufs, impl, cfg, unroll, offset_src=False)
    if op == "dp_memcpy(src@off)":
        return _memcpy_program(bufs, impl, cfg, unroll, offset_src=True)
    if op == "slice_pad":
        return _slice_pad_program(bufs, impl, cfg, unroll)
    if op == "merge_rows":
        return _merge_program(bufs, impl, cfg, unroll)
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


def moved_bytes(op, rows, row_bytes):
    """Bytes read plus written by one call of ``op`` in this bench."""
    if op == "slice_pad":
        return (rows - rows // 16 + rows) * row_bytes
    return 2 * rows * row_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    """How many calls one timed batch holds.

    Attributes:
      unroll: calls written out in one program.
      runs: programs enqueued back to back per timed batch.
      reps: timed batches (the median is reported).
    """

    unroll: int
    runs: int
    reps: int


def plan_for(moved, iters, reps):
    """A ``Plan`` moving about ``TARGET_BYTES_PER_REP`` per batch (or ``iters`` calls)."""
    unroll = int(np.clip(4 * GIB // max(moved, 1), 4, 16))
    calls = iters or int(np.clip(TARGET_BYTES_PER_REP // max(moved, 1), unroll, 64 * unroll))
    unroll = min(unroll, calls)
    return Plan(unroll=unroll, runs=max(calls // unroll, 1), reps=reps)


def time_program(fn, args, chained, plan):
    """Median seconds per call; the first (compiling) run is not timed."""
    first, rest = args[0], args[1:]
    out = jax.block_until_ready(fn(first, *rest))
    first = out if chained else first
    times = []
    for _ in range(plan.reps):
        t0 = time.perf_counter()
        for _ in range(plan.runs):
            out = fn(first, *rest)
            first = out if chained else first
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / (plan.runs * plan.unroll))
    return statistics.median(times)


def op_gbs(op, bufs, impl, cfg, plan, row_bytes):
    """GB/s of ``op`` (bytes read plus written per second)."""
    fn, args, chained = program(op, bufs, impl, cfg, plan.unroll)
    return moved_bytes(op, bufs.rows, row_bytes) / time_program(fn, args, chained, plan) / 1e9


def torch_copy_seconds(nbytes, calls, reps):
    """Median seconds of one ``torch.Tensor.copy_`` of ``nbytes`` on the GPU."""
    import torch  # noqa: PLC0415  (optional yardstick, GPU machines only)

    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del src, dst
    torch.cuda.empty_cache()  # give the memory back before JAX fills the next size
    return statistics.median(times)


def xla_copy_seconds(bufs, plan):
    """Median seconds of XLA's plain copy (``x + s``, one fused pass) of ``bufs.small``."""

    def run(x, adds):
        return tuple(x + s.astype(x.dtype) for s in adds)

    args = (bufs.small, _scalars(range(1, plan.unroll + 1)))
    return time_program(jax.jit(run), args, False, plan)


def torch_usable():
    """Whether the torch yardstick can run (torch imports and JAX runs on a GPU)."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return jax.default_backend() == "gpu" and torch.cuda.is_available()


def ceiling(bufs, nbytes, plan):
    """(GB/s, label) of the plain copy yardstick for a copy of ``nbytes``."""
    if torch_usable():
        seconds = torch_copy_seconds(nbytes, plan.unroll * plan.runs, plan.reps)
        return 2 * nbytes / seconds / 1e9, "torch copy_"
    return 2 * nbytes / xla_copy_seconds(bufs, plan) / 1e9, "best XLA copy"


_START = time.perf_counter()


def _emit(line, lines):
    # Printed as measured (with seconds since start), so a run cut short still reports.
    print(f"{line}  [{time.perf_counter() - _START:.0f}s]", flush=True)
    lines.append(line)


TABLE_HEAD = (
    "| op | impl | rows x cols | dtype | payload MiB | GB/s | of ceiling | vs xla |",
    "|---|---|---|---|---|---|---|---|",
)


def table_row(op, impl, rows, cols, dtype, gbs, ceil_gbs, xla_gbs):
    """One markdown row: op, impl, rows x cols, dtype, payload, GB/s, of ceiling, vs xla."""
    payload = rows * cols * dtype.itemsize / MIB
    vs = f"{gbs / xla_gbs:.2f}x" if xla_gbs else "-"
    return (
        f"| {op} | {impl} | {rows} x {cols} | {dtype.name} | "
        f"{payload:.0f} | {gbs:.0f} | {gbs / ceil_gbs:.2f} | {vs} |"
    )


def measure(size_bytes, cols, dtype, impl_names, args, lines):
    """Measures every op and impl at one size; emits the ceiling line and table rows."""
    bufs = make_buffers(size_bytes, cols, dtype)
    row_bytes = cols * dtype.itemsize
    payload = bufs.rows * row_bytes
    plan = plan_for(2 * payload, args.iters, args.reps)
    ceil_gbs, label = ceiling(bufs, payload, plan)
    _emit(f"ceiling {payload // MIB} MiB copy: {ceil_gbs:.0f} GB/s ({label})", lines)
    xla = {}
    for impl in impl_names:
        for op in OPS:
            gbs = op_gbs(op, bufs, impl, None, plan, row_bytes)
            xla.setdefault(op, gbs if impl == "xla" else None)
            _emit(table_row(op, impl, bufs.rows, cols, dtype, gbs, ceil_gbs, xla[op]), lines)


def sweep(size_bytes, cols, dtype, impl_names, args, lines):
    """Times ``SWEEP_CONFIGS`` per kernel impl and op; emits points, then a best-of table."""
    bufs = make_buffers(size_bytes, cols, dtype)
    row_bytes = cols * dtype.itemsize
    plan = plan_for(2 * bufs.rows * row_bytes, args.iters, args.reps)
    ceil_gbs, label = ceiling(bufs, bufs.rows * row_bytes, plan)
    _emit(f"sweep ceiling {size_bytes // MIB} MiB copy: {ceil_gbs:.0f} GB/s ({label})", lines)
    best = {}
    for impl in (i for i in impl_names if i != "xla"):
        for block, warps, evict in SWEEP_CONFIGS:
            cfg = copy_config.CopyConfig(block_elems=block, num_warps=warps, eviction_policy=evict)
            for op in args.sweep_ops.split(","):
                gbs = op_gbs(op, bufs, impl, cfg, plan, row_bytes)
                _emit(f"sweep {op} {impl} {cfg.describe()}: {gbs:.0f} GB/s", lines)
                if gbs > best.get((op, impl), (0, None))[0]:
                    best[op, impl] = (gbs, cfg)
    _emit(f"best config per op and impl at {size_bytes // MIB} MiB:", lines)
    _emit("| op | impl | best config | GB/s | of ceiling |", lines)
    _emit("|---|---|---|---|---|", lines)
    for (op, impl), (gbs, cfg) in best.items():
        _emit(f"| {op} | {impl} | {cfg.describe()} | {gbs:.0f} | {gbs / ceil_gbs:.2f} |", lines)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jtbo.bench kernels", description=__doc__)
    p.add_argument("--sizes-mib", default="1,16,256,1024")
    p.add_argument("--cols", type=cli_arguments.positive_int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impls", default=None, help="comma list; default: all available here")
    p.add_argument(
        "--reps", type=cli_arguments.positive_int, default=5, help="timed batches per case (median)"
    )
    p.add_argument("--iters", type=int, default=0, help="calls per timed batch (0: automatic)")
    p.add_argument("--sweep-mib", type=int, default=0, help="also sweep configs at this size")
    p.add_argument("--sweep-ops", default=SWEEP_OPS)
    p.add_argument("--out", default=None, help="also write the report to this file")
    return p.parse_args(argv)


def main(argv):
    """Prints the kernel bandwidth table (and an optional config sweep with its summary)."""
    args = _parse(argv)
    dtype = jnp.dtype(args.dtype)
    platform = jax.default_backend()
    names = args.impls.split(",") if args.impls else [
        i for i in kernels.IMPLS if impls_lib.unavailable_reason(i, platform) is None
    ]  # fmt: skip
    lines = []
    _emit(
        f"date {datetime.date.today()}  device {jax.devices()[0].device_kind}  "
        f"jax {jax.__version__}  defaults (>= 1 MiB): "
        + ", ".join(
            f"{op} {impls_lib.resolve(None, op=op, payload_bytes=MIB)}" for op in impls_lib.FASTEST
        )
        + f"; configs dp_memcpy {copy_config.DP_MEMCPY.describe()}, slice_pad "
        f"{copy_config.SLICE_PAD.describe()}, merge_rows {copy_config.MERGE_ROWS.describe()}",
        lines,
    )
    for line in TABLE_HEAD:
        _emit(line, lines)
    for mib in map(int, filter(None, args.sizes_mib.split(","))):
        measure(mib * MIB, args.cols, dtype, names, args, lines)
    if args.sweep_mib:
        sweep(args.sweep_mib * MIB, args.cols, dtype, names, args, lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
