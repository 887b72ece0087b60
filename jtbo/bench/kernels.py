"""Bandwidth of the jtbo.kernels ops against the device's copy ceiling.

``python -m jtbo.bench kernels [--sizes-mib 1,16,256,1024] [--cols 4096]
[--dtype bfloat16] [--impls xla,pallas,triton] [--sweep-mib 256] [--out FILE]``

Each op moves ``S`` bytes of payload (``S`` = the size): ``dp_memcpy`` copies S bytes
into / out of a buffer at a row offset; ``slice_pad`` copies 15/16 of a child of S
bytes and zero-fills the rest; ``merge_rows`` writes two children covering S bytes.
GB/s counts bytes read plus bytes written. The ceiling is measured in the same run
on a plain device-to-device copy of the same bytes: ``torch.Tensor.copy_`` when
torch imports (used only as this yardstick), else the best of XLA's own copies; the
table names which. Timing: one jitted ``fori_loop`` of ``--iters`` calls (so launch
overhead does not dominate small sizes), the per-call median of ``--reps`` runs; the
offsets move by one row between iterations so XLA cannot hoist the call.
``--sweep-mib`` also times a grid of ``CopyConfig``s for the kernel impls at one size.
"""

import argparse
import dataclasses
import datetime
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import kernels
from jtbo.kernels import config as config_lib
from jtbo.kernels import impls as impls_lib

MIB = 1 << 20
SWEEP_BLOCKS = (4096, 16384, 65536)
SWEEP_WARPS = (4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed op at one size.

    Attributes:
      op: op name.
      rows: payload rows.
      cols: elements per row.
      dtype: element type.
      moved: bytes read plus written per call.
      make: builds ``(step, init)``: ``step(i, carry) -> carry`` and its first carry.
    """

    op: str
    rows: int
    cols: int
    dtype: object
    moved: int
    make: object


def _rand(key, rows, cols, dtype):
    return jax.random.normal(key, (rows, cols), jnp.float32).astype(dtype) + 1


def _memcpy_case(rows, cols, dtype, offset_src, impl, cfg):
    keys = jax.random.split(jax.random.key(0), 2)
    small, big = _rand(keys[0], rows, cols, dtype), _rand(keys[1], 2 * rows, cols, dtype)
    src, dst = (big, small) if offset_src else (small, big)

    def step(i, dst):
        off = rows // 3 + i % 2
        return kernels.dp_memcpy(dst, src, off, rows, offset_src=offset_src, impl=impl, config=cfg)

    return step, dst


def _slice_pad_case(rows, cols, dtype, impl, cfg):
    x = _rand(jax.random.key(1), 2 * rows, cols, dtype)
    length = rows - rows // 16

    def step(i, out):
        del out  # carried only so that every iteration's whole output stays live
        return kernels.slice_pad(x, rows // 3 + i % 2, length, capacity=rows, impl=impl, config=cfg)

    return step, jnp.zeros((rows, cols), dtype)


def _merge_case(rows, cols, dtype, impl, cfg):
    half = rows // 2
    keys = jax.random.split(jax.random.key(2), 2)
    a, b = (_rand(k, half + rows // 16, cols, dtype) for k in keys)

    def step(i, out):
        del out  # carried only so that every iteration's whole output stays live
        split = half - i % 2
        return kernels.merge_rows(
            [a, b], [0, split], [split, rows - split], out_len=rows, impl=impl, config=cfg
        )

    return step, jnp.zeros((rows, cols), dtype)


def cases(size_bytes, cols, dtype, impl, cfg=None):
    """The four timed ops at one payload size, for one impl."""
    rows = size_bytes // (cols * jnp.dtype(dtype).itemsize)
    row_bytes = cols * jnp.dtype(dtype).itemsize
    slice_moved = (rows - rows // 16 + rows) * row_bytes
    return [
        Case("dp_memcpy(dst@off)", rows, cols, dtype, 2 * rows * row_bytes,
             lambda: _memcpy_case(rows, cols, dtype, False, impl, cfg)),
        Case("dp_memcpy(src@off)", rows, cols, dtype, 2 * rows * row_bytes,
             lambda: _memcpy_case(rows, cols, dtype, True, impl, cfg)),
        Case("slice_pad", rows, cols, dtype, slice_moved,
             lambda: _slice_pad_case(rows, cols, dtype, impl, cfg)),
        Case("merge_rows", rows, cols, dtype, 2 * rows * row_bytes,
             lambda: _merge_case(rows, cols, dtype, impl, cfg)),
    ]  # fmt: skip


def time_loop(step, init, iters, reps):
    """Median seconds per call of ``step`` run ``iters`` times in one jitted loop."""
    run = jax.jit(lambda c: jax.lax.fori_loop(0, iters, step, c), donate_argnums=0)
    carry = jax.block_until_ready(run(jnp.copy(init)))  # compile + warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(run(carry))
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def torch_copy_seconds(nbytes, iters, reps):
    """Median seconds of one ``torch.Tensor.copy_`` of ``nbytes`` on the GPU."""
    import torch  # noqa: PLC0415  (optional yardstick, GPU machines only)

    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def xla_copy_seconds(nbytes, iters, reps):
    """Median seconds of XLA's best plain copy (``x + 1`` or a reverse) of ``nbytes``."""
    x = jax.random.normal(jax.random.key(3), (nbytes // 4,), jnp.float32)
    variants = (lambda i, y: y + 1, lambda i, y: y[::-1])
    return min(time_loop(v, x, iters, reps) for v in variants)


def ceiling(nbytes, iters, reps):
    """(GB/s, label) of the plain copy yardstick for a copy of ``nbytes``."""
    try:
        import torch  # noqa: F401, PLC0415

        usable = jax.default_backend() == "gpu" and torch.cuda.is_available()
    except ImportError:
        usable = False
    if usable:
        return 2 * nbytes / torch_copy_seconds(nbytes, iters, reps) / 1e9, "torch copy_"
    return 2 * nbytes / xla_copy_seconds(nbytes, iters, reps) / 1e9, "best XLA copy"


def _iters(nbytes):
    return int(np.clip(8 * 1024 * MIB // max(nbytes, 1), 4, 200))


_START = time.perf_counter()


def _emit(line, lines):
    # Printed as measured (with seconds since start), so a run cut short still reports.
    print(f"{line}  [{time.perf_counter() - _START:.0f}s]", flush=True)
    lines.append(line)


def table_row(case, impl, gbs, ceil_gbs, xla_gbs):
    """One markdown row: op, impl, rows x cols, dtype, payload, GB/s, of ceiling, vs xla."""
    dtype = jnp.dtype(case.dtype)
    payload = case.rows * case.cols * dtype.itemsize / MIB
    vs = f"{gbs / xla_gbs:.2f}x" if xla_gbs else "-"
    return (
        f"| {case.op} | {impl} | {case.rows} x {case.cols} | {dtype.name} | "
        f"{payload:.0f} | {gbs:.0f} | {gbs / ceil_gbs:.2f} | {vs} |"
    )


TABLE_HEAD = (
    "| op | impl | rows x cols | dtype | payload MiB | GB/s | of ceiling | vs xla |",
    "|---|---|---|---|---|---|---|---|",
)


def measure(size_bytes, cols, dtype, impl_names, reps, lines):
    """Measures every op and impl at one size; emits the ceiling line and table rows."""
    iters = _iters(size_bytes)
    ceil_gbs, label = ceiling(size_bytes, iters, reps)
    _emit(f"ceiling {size_bytes // MIB} MiB copy: {ceil_gbs:.0f} GB/s ({label})", lines)
    xla = {}
    for impl in impl_names:
        for case in cases(size_bytes, cols, dtype, impl):
            step, init = case.make()
            gbs = case.moved / time_loop(step, init, iters, reps) / 1e9
            xla.setdefault(case.op, gbs if impl == "xla" else None)
            _emit(table_row(case, impl, gbs, ceil_gbs, xla[case.op]), lines)


def sweep(size_bytes, cols, dtype, impl_names, reps, lines, ops):
    """Emits ``sweep op impl block warps GB/s`` over the ``CopyConfig`` grid."""
    iters = _iters(size_bytes)
    for impl in (i for i in impl_names if i != "xla"):
        for block in SWEEP_BLOCKS:
            for warps in SWEEP_WARPS:
                cfg = config_lib.CopyConfig(block_elems=block, num_warps=warps)
                for case in cases(size_bytes, cols, dtype, impl, cfg):
                    if case.op not in ops:
                        continue
                    step, init = case.make()
                    gbs = case.moved / time_loop(step, init, iters, reps) / 1e9
                    _emit(f"sweep {case.op} {impl} block={block} warps={warps}: {gbs:.0f}", lines)


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jtbo.bench kernels", description=__doc__)
    p.add_argument("--sizes-mib", default="1,16,256,1024")
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impls", default=None, help="comma list; default: all available here")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sweep-mib", type=int, default=0, help="also sweep configs at this size")
    p.add_argument("--sweep-ops", default="dp_memcpy(dst@off),slice_pad,merge_rows")
    p.add_argument("--out", default=None, help="also write the report to this file")
    return p.parse_args(argv)


def main(argv):
    """Prints the kernel bandwidth table (and an optional config sweep)."""
    args = _parse(argv)
    dtype = jnp.dtype(args.dtype)
    platform = jax.default_backend()
    names = args.impls.split(",") if args.impls else [
        i for i in kernels.IMPLS if impls_lib.unavailable_reason(i, platform) is None
    ]  # fmt: skip
    lines = []
    _emit(
        f"date {datetime.date.today()}  device {jax.devices()[0].device_kind}  "
        f"jax {jax.__version__}  default impl {impls_lib.resolve(None)}",
        lines,
    )
    if args.sweep_mib:
        ops = args.sweep_ops.split(",")
        sweep(args.sweep_mib * MIB, args.cols, dtype, names, args.reps, lines, ops)
    for line in TABLE_HEAD:
        _emit(line, lines)
    for mib in map(int, filter(None, args.sizes_mib.split(","))):
        measure(mib * MIB, args.cols, dtype, names, args.reps, lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
