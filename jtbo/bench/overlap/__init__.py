"""``python -m jtbo.bench overlap``: does an async collective run beside independent compute?

Two-batch overlap only pays if, at run time, a collective's transfer proceeds while the GPU
computes something else. This probe measures that directly, one collective at a time
(``--collectives``, default ``all_to_all,all_gather,psum_scatter``), with three jitted
programs, each one ``jax.shard_map`` over every device (a 1-D mesh, axis ``PROBE_AXIS``):

- comm alone: a chain of ``--chain`` collectives on a per-device buffer, each waiting for the
  last through a small elementwise step (``all_to_all``: the first received row overwritten
  in place by the negated first sent row, so the chain's serial part is the exchange
  itself; ``all_gather``: a weighted mean of the gathered chunks, back to the input size;
  ``psum_scatter``: tile the scattered chunk ``ndev`` times and divide by ``ndev``, back to
  the input size);
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
block, by data dependence. ``all_to_all_peer_copy`` (``jtbo.collectives.peer_copy``) is an
explicit start and wait, which XLA schedules as ordinary calls: a third barrier ties its
started exchange to the matmul input, so the start is issued before the window's matmuls and
the wait after them. ``--windows free`` runs the two chains as independent dataflow
(one body returns both) and leaves the interleaving to XLA's scheduler. Pinned is the
default because the probe asks whether the exchange *can* run beside compute, given a
schedule that asks for it (as the TBO step's barriers do): with free windows XLA's
latency-hiding scheduler, which estimates a collective as short, puts about one matmul
inside each start/done window, and a GPU runs that schedule in order on one compute stream,
so ``hidden`` then measures XLA's placement rather than the hardware's (a small fraction for
a large all-to-all on two H200s). ``free`` shows what XLA's own schedule does. The barriers are
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
``--cpu-devices`` devices each. ``--profile DIR`` traces ``PROFILE_RUNS`` runs of each
collective's comm-alone and both programs after all timings and, on a GPU, prints for each the
share of communication kernel time (NCCL kernels, peer copies) that ran under compute kernels
and the busy times against the trace's span (``jtbo.bench.kernel_time``). The traces are what
the wall-clock ``hidden`` cannot show: a comm-alone span well above its kernels' busy time is
a fixed cost per exchange (launch, host-side coordination), which ``hidden`` counts as
communication that did not hide.

Defaults: ``--bytes`` 448 MiB and ``--matmul`` 8192 on an accelerator, 256 KiB and 128 on the
CPU (decided in the measuring process from ``jax.devices()[0].platform``); a default
``--bytes`` is rounded down to a valid multiple, an explicit one must be one.
"""

from jtbo.bench.overlap.check import TOLERANCE, check_close
from jtbo.bench.overlap.children import run_variant, worker_argv
from jtbo.bench.overlap.cli import main
from jtbo.bench.overlap.collectives import COLLECTIVES, PROBE_AXIS, Collective
from jtbo.bench.overlap.inputs import device_block
from jtbo.bench.overlap.probe import ProbeInputs, make_inputs, measure, probe_collective
from jtbo.bench.overlap.processes import RESULT_MARKER
from jtbo.bench.overlap.profiling import PROFILE_RUNS, nccl_lines, profile_program
from jtbo.bench.overlap.programs import BOTH_BODIES, WINDOW_MODES
from jtbo.bench.overlap.reference import CHECK_COLUMNS, comm_reference, matmul_reference
from jtbo.bench.overlap.results import ProbeResult, RunInfo, VariantOutcome, hidden_fraction
from jtbo.bench.overlap.sizes import COLUMNS, ProbeSizes, buffer_rows, resolve_sizes
from jtbo.bench.overlap.table import TABLE_HEADER, header_line, print_report, result_row
from jtbo.bench.overlap.timing import (
    MAX_MATMULS_PER_WINDOW,
    balanced_matmuls_per_window,
    calibrate_matmuls_per_window,
    median_seconds,
)
from jtbo.bench.overlap.variants import Variant, format_option_value, parse_variant, variants_of

CONFIGURES_JAX = True  # main sets jax options (CPU devices, collectives) before backend start

__all__ = [
    "BOTH_BODIES",
    "CHECK_COLUMNS",
    "COLLECTIVES",
    "COLUMNS",
    "MAX_MATMULS_PER_WINDOW",
    "PROBE_AXIS",
    "PROFILE_RUNS",
    "RESULT_MARKER",
    "TABLE_HEADER",
    "TOLERANCE",
    "WINDOW_MODES",
    "Collective",
    "ProbeInputs",
    "ProbeResult",
    "ProbeSizes",
    "RunInfo",
    "Variant",
    "VariantOutcome",
    "balanced_matmuls_per_window",
    "buffer_rows",
    "calibrate_matmuls_per_window",
    "check_close",
    "comm_reference",
    "device_block",
    "format_option_value",
    "hidden_fraction",
    "header_line",
    "main",
    "make_inputs",
    "matmul_reference",
    "measure",
    "median_seconds",
    "nccl_lines",
    "parse_variant",
    "print_report",
    "probe_collective",
    "profile_program",
    "resolve_sizes",
    "result_row",
    "run_variant",
    "variants_of",
    "worker_argv",
]
