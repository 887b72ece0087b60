"""``python -m jtbo.bench tbo``: step time with two-batch overlap vs without, one device group.

TBO's cost when there is nothing to hide: on one H200 the step has no communication, so TBO
can only lose (two half-size micro-batches, split/merge copies). The model is DeepSeek-V3's
hidden size, expert shape and MLA attention reduced to fit (``MoEConfig.deepseek_v3_reduced``:
hidden 7168, 64 experts, top-8 + 1 shared, 4 layers, bf16); ``--attention-kind gqa`` swaps its
MLA for GQA (``MoEConfig.deepseek_v3_gqa_reduced``; the header line names the KV-cache
bytes per token); ``--hf-config FILE [--num-layers N]`` takes a published model's real
dimensions from its ``config.json`` instead (random weights; ``jtbo.bench.hf_configs``, the
files under ``tools/hf_configs/``). Cases: prefill of 4096-16384 tokens per DP rank
(prompts of ``--prompt-len`` tokens) and decode of 64-256 sequences (context ``--context``).
For each case one ``ModelRunner`` plans the same batch twice (TBO on and off) and runs the two
jitted steps in turn; the time is the median of ``--iters`` runs after warm-up,
device-synchronised, without host planning or copying logits back. Each step computes the
logits of each sequence's last token only (``--logits last``, what ``generate`` serves: the LM
head runs on those rows); ``--logits all`` computes every token's. Decode sequences have
their cached context in their own KV slots (``decode_prefix``). The "Δ logits" column compares
the TBO step's logits with the plain step's (``_agreement``; ``--dtype float32`` takes bf16
rounding out); the last column is what the runner's numerics guard adds to a step (the
on-device finiteness flags of the plain step's logits and their read-back, ``_guard_time``:
what ``ModelRunner(check_finite_logits=False)`` saves). Prints a markdown table (target:
ratio <= 1.05 at prefill >= 4096 tokens and decode >= 128 sequences), a table of the host
phases of the plain and TBO steps of each case (``ModelRunner.last_step_phases``: the plan's
inputs, the jitted call, the wait for the EP counts; ``jtbo.runner.step_phases``), then one
line per case comparing the plain step with its physical limit (``jtbo.bench.limits``: useful FLOPs
at a bf16 matmul rate for prefill, weight and KV bytes at the copy bandwidth for decode, both
rates measured in the same run), and, with ``--logits last``, the plain step's device time
against the same limit: its greedy token program (``ModelRunner.run_token_plan``) enqueued back
to back, the host's work hidden under the devices' (``back_to_back_ms``). ``--devices N`` runs
DP attention over N devices (dp=N, EP over all of them: the multi-GPU measurement),
and ``--barriers`` adds a column for TBO with round barriers (a second runner).
``--prefill-skew S`` gives every rank but rank 0 ``S`` times the case's prefill tokens (the
tokens/rank column lists each rank's); with ``--moe-a2a-backend none`` the DP gathers of such
steps are where SUM_LEN pays, and ``--dp-padding auto|max_len|sum_len`` picks the runners'
mode (a line under the table names each case's mode and gathered rows). A line under the table
names each case's TBO micro-batch rows: the child capacity its plan took (the smallest of
``--tbo-child-buckets`` capacities that holds its split, ``planning.child_capacities``).

The ``auto`` columns are a third runner with ``enable_two_batch_overlap="auto"``: one
``forward`` of the case's batch lets it time both programs and choose (``tbo_auto``, its
default trials and margin), then its chosen step is timed in the same interleaved loop as the
others. They show its time, that time over ``min(no TBO, TBO)`` (about 1.0 when it chose the
faster program) and its choice with the TBO / plain ratio it measured.

After every timing, on a GPU, ``PROFILE_STEPS`` plain and TBO steps of every case are traced
(``jax.profiler``, with the optimized HLO dumped beside them: into ``--profile DIR``, else a
``tempfile.mkdtemp`` folder; ``--no-profile`` skips this) and a second table says what was
hidden, per case and column (``OverlapRow``): the NCCL time under compute, compute and
communication busy time, the measured step time over ``max(compute, communication)``, the
bytes of one EP all-to-all per device and the achieved GB/s per GPU (collective bytes of the
compiled step over communication busy time: NCCL kernels, or the peer-copy exchange's
peer copies; ``kernel_time.collective_bytes``). ``--profile DIR`` also
prints the kernel time per model operation (``kernel_time.compare_table``). On the CPU the
trace has no NCCL kernels: one line says so.

Environment (set at the top of ``main``, before the JAX backend starts; importing this module
does not start it): ``--link host`` sets ``NCCL_P2P_DISABLE=1`` (SHM stays on), so NCCL moves
data between the GPUs of one host through host memory, a stand-in for an inter-host link, and
``JTBO_PEER_COPY_VIA_HOST=1``, so the peer-copy exchange stages its blocks through pinned host
memory too (copy engines, device to host and back); ``--link nvlink`` (default) leaves P2P on.
``NCCL_NVLS_ENABLE`` defaults to 0 (NVLink multicast stays off, as the lent machines require).
``--env K=V`` sets further variables, and ``--xla-option K=V`` appends ``--K=V`` to
``XLA_FLAGS``: that reaches every compile, plain and TBO alike, and an option the step passes
itself (``step.step_compiler_options``) keeps the step's value.
"""

import argparse
import dataclasses
import glob
import os
import statistics
import tempfile
import time
from collections.abc import MutableMapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo import split
from jtbo.analysis import hlo_schedule
from jtbo.attention import backend as attn_backend_lib
from jtbo.bench import device_rates, hf_configs, kernel_time, limits, options
from jtbo.collectives import ep_config
from jtbo.collectives import mesh as mesh_lib
from jtbo.core import cli_arguments
from jtbo.models import config as config_lib
from jtbo.models import ep_dispatchers, layer_ops
from jtbo.models import model as model_lib
from jtbo.overlap import xla_options
from jtbo.runner import (
    ep_stats_file,
    last_rows,
    numerics,
    planning,
    step_phases,
    tbo_auto,
    tbo_options,
)
from jtbo.runner import runner as runner_lib

CONFIGURES_JAX = True  # main sets XLA / NCCL variables before the backend starts

ForwardMode = split.ForwardMode

LINK_ENVIRONMENT = {
    "nvlink": {"NCCL_P2P_DISABLE": "0", "JTBO_PEER_COPY_VIA_HOST": "0"},
    "host": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "0", "JTBO_PEER_COPY_VIA_HOST": "1"},
}
"""Transport variables of each ``--link``: ``host`` turns NCCL's GPU peer-to-peer transport off,
so the GPUs of one host exchange through shared host memory (SHM explicitly on), and stages the
peer-copy exchange through pinned host memory (``jtbo.collectives.peer_copy``)."""
NVLS_ENVIRONMENT = ("NCCL_NVLS_ENABLE", "0")
"""Default of NVLink multicast (NVLS): off, as the lent machines require."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jtbo.bench tbo", description=__doc__)
    options.add_arguments(parser, TboBenchOptions)
    _add_profile_arguments(parser)
    _add_environment_arguments(parser)
    return parser


def _add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument(
        "--profile", metavar="DIR",
        help="trace every case into DIR (default: a fresh temporary folder) and also print "
        "the GPU time per operation (jtbo.bench.kernel_time)",
    )  # fmt: skip
    profile.add_argument("--no-profile", action="store_true", help="no traces, no overlap table")


def _add_environment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--link", choices=tuple(LINK_ENVIRONMENT), default="nvlink",
        help="host: NCCL_P2P_DISABLE=1 (SHM on), the GPUs exchange through host memory, a "
        "stand-in for an inter-host link; nvlink: P2P on",
    )  # fmt: skip
    parser.add_argument(
        "--env", metavar="K=V", type=_environment_pair, action="append", default=[],
        help="set an environment variable before the JAX backend starts (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--xla-option", metavar="K=V", type=xla_options.parse_option, action="append",
        default=[],
        help="append --K=V to XLA_FLAGS before the backend starts (repeatable): applies to "
        "every compile, plain and TBO steps alike; an option the step passes itself "
        "(step.step_compiler_options: the command-buffer list, on several GPUs the TBO "
        "step's xla_options.tbo_compiler_options) keeps the step's value",
    )  # fmt: skip


def _skew(text: str) -> float:
    """``--prefill-skew`` as a float in ``(0, 1]``.

    Raises:
      argparse.ArgumentTypeError: not a number in ``(0, 1]``.
    """
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--prefill-skew takes a number in (0, 1], got {text!r}")
    return value


_POSITIVE = cli_arguments.positive_int


@dataclasses.dataclass(frozen=True)
class TboBenchOptions:
    """The benchmark's cases, mesh, MoE and model options, one flag each (``_parser``)."""

    prefill: list[int] = options.option([4096, 8192, 16384], type=_POSITIVE, nargs="*")
    decode: list[int] = options.option([64, 128, 256], type=_POSITIVE, nargs="*")
    prompt_len: int = options.option(2048, type=_POSITIVE)  # decode cases: prompt tokens
    context: int = options.option(1024, type=_POSITIVE, help="decode KV length")
    iters: int = options.option(15, type=_POSITIVE, help="timed steps per column")
    logits: str = options.option(
        "last", choices=last_rows.LOGITS_MODES,
        help="logits rows each step computes: each sequence's last (what generate serves, "
        "the default) or every token's (ModelRunner.forward(logits=...))",
    )  # fmt: skip
    devices: int | None = options.option(
        None, type=_POSITIVE, help="shorthand for --dp N --attn-tp 1"
    )
    dp: int = options.option(1, type=_POSITIVE)  # DP ranks
    attn_tp: int = options.option(1, type=_POSITIVE)  # devices per DP rank
    moe_a2a_backend: str = options.option("ep", choices=("ep", "none"))  # MoE exchange
    dp_padding: str = options.option(
        "auto", choices=planning.DP_PADDING_CHOICES,
        help="DP padding of the 'none' backend's gathers: ModelRunner(dp_padding=...); "
        "sum_len needs --moe-a2a-backend none",
    )  # fmt: skip
    prefill_skew: float = options.option(
        1.0, type=_skew, metavar="S",
        help="prefill cases: rank 0 gets the case's tokens, every other rank S times as many "
        "(0 < S <= 1; 1: equal ranks)",
    )  # fmt: skip
    ep_capacity_factor: float = options.option(4.0, type=float)  # EP slots per balanced load
    ep_dedup: bool = options.option(
        True, action=argparse.BooleanOptionalAction,
        help="EP sends each token once per destination GPU (DeepEP-style) with its local "
        "expert ids and weights (the default); --no-ep-dedup: once per (token, expert)",
    )  # fmt: skip
    ep_exchange_tbo: str | None = options.option(
        None, choices=ep_config.EXCHANGES,
        help="EP exchange of the TBO steps (default: --ep-exchange), e.g. --ep-exchange dense "
        "--ep-exchange-tbo peer_copy: NCCL in plain steps, copy engines where TBO overlaps",
    )  # fmt: skip
    ep_routing_stats: str | None = options.option(
        None, metavar="FILE",
        help="EP capacities from the peak loads in FILE where it exists (headroom 1.25), and "
        "FILE (re)written with this run's peaks after the timing",
    )  # fmt: skip
    ep_exchange: str = options.option(
        "dense", choices=ep_config.EXCHANGES,
        help="EP exchange: XLA's all-to-all of fixed slots (dense), of the filled slots only "
        "(ragged), or copy-engine peer copies on a side stream (peer_copy, one process)",
    )  # fmt: skip
    moe_runner_backend: str | None = options.option(
        None, choices=layer_ops.MOE_RUNNER_BACKENDS,
        help="routed experts' FFN: batched matmul over every slot, or the grouped GEMM kernel "
        "(default: the runner's, the fastest on this platform)",
    )  # fmt: skip
    moe_runner_backend_tbo: str | None = options.option(
        None, choices=layer_ops.MOE_RUNNER_BACKENDS,
        help="routed experts' FFN of the TBO steps (default: --moe-runner-backend)",
    )  # fmt: skip
    ep_overflow_policy: str = options.option(
        "rerun", choices=("rerun", "raise"),
        help="a step that overflows EP capacity re-runs with the next bucket (warm-up absorbs it)",
    )  # fmt: skip
    tiny: bool = options.option(False, action="store_true", help="MoEConfig.tiny() (smoke test)")
    attention_kind: str | None = options.option(
        None, choices=("mla", "gqa"),
        help="the preset model's attention: DeepSeek's MLA (the default; "
        "MoEConfig.deepseek_v3_reduced(); tiny_mla() with --tiny) or GQA "
        "(deepseek_v3_gqa_reduced(); tiny())",
    )  # fmt: skip
    hf_config: Path | None = options.option(
        None, type=cli_arguments.existing_file, metavar="FILE",
        help="a Hugging Face config.json instead of a preset: jtbo maps it, random weights "
        "(its own attention: not with --tiny or --attention-kind)",
    )  # fmt: skip
    num_layers: int | None = options.option(
        None, type=cli_arguments.positive_int, metavar="N",
        help="keep the first N layers of --hf-config",
    )  # fmt: skip
    attention_backend: str | None = options.option(
        None, choices=tuple(attn_backend_lib.ATTENTION_BACKENDS),
        help="ModelRunner(attention_backend=...) of every runner (default: the runner's)",
    )  # fmt: skip
    dtype: str = options.option(
        "bfloat16", choices=("bfloat16", "float32"),
        help="parameter / activation dtype (float32: the agreement column without bf16 rounding)",
    )  # fmt: skip
    expert_dtype: str | None = options.option(
        None, choices=("bfloat16", "float8_e4m3fn"),
        help="routed experts' weights: block-scaled FP8 (float8_e4m3fn; MoEConfig.expert_dtype) "
        "or as the other weights (the default; bfloat16 with --dtype bfloat16)",
    )  # fmt: skip
    tbo_child_buckets: int = options.option(
        split.DEFAULT_CHILD_BUCKETS, type=int, metavar="N",
        help="TboOptions(tbo_child_buckets=N): micro-batch capacities per token bucket, from "
        "the even split's half bucket to the most uneven split's bound (1: the bound alone)",
    )  # fmt: skip
    barriers: bool = options.option(
        False, action="store_true",
        help="also time TBO with round barriers (a second runner; column 'TBO+barriers')",
    )  # fmt: skip


def _environment_pair(text: str) -> tuple[str, str]:
    """``K=V`` of ``--env`` as ``(K, V)``.

    Raises:
      argparse.ArgumentTypeError: no ``=`` or an empty name.
    """
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--env takes NAME=VALUE, got {text!r}")
    return name.strip(), value


def configure_environment(
    args: argparse.Namespace, environ: MutableMapping[str, str], dump_dir: str | None
) -> None:
    """Sets what must be in place before the JAX backend starts (see the module docstring).

    Args:
      args: the parsed flags (``--link``, ``--env``, ``--xla-option``).
      environ: the environment to change (``os.environ`` in ``main``).
      dump_dir: folder for the step's optimized HLO (``_dump_flags``), or None for no dump.

    Raises:
      ValueError: ``--env`` names a variable that ``--link`` sets.
    """
    link = LINK_ENVIRONMENT[args.link]
    clashes = sorted({name for name, _ in args.env} & set(link))
    if clashes:
        raise ValueError(f"--env {clashes} clash with --link {args.link}: use --link")
    environ.update(link)
    environ.update(dict(args.env))
    environ.setdefault(*NVLS_ENVIRONMENT)
    flags = [f"--{name}={_flag_value(value)}" for name, value in args.xla_option]
    flags += _dump_flags(dump_dir) if dump_dir else []
    if flags:
        environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", ""), *flags]).strip()


def _flag_value(value: str | int | bool | float) -> str:
    """An ``xla_options.parse_option`` value as XLA's flag parser reads it (true / false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _prefill_batch(tokens: int, prompt_len: int, vocab: int) -> split.ForwardBatch:
    lens = [prompt_len] * (tokens // prompt_len) + (
        [tokens % prompt_len] if tokens % prompt_len else []
    )
    n = len(lens)
    return split.ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=n, input_ids=np.arange(tokens) % vocab,
        positions=np.concatenate([np.arange(k) for k in lens]),
        out_cache_loc=np.arange(1, tokens + 1), req_pool_indices=np.arange(n), seq_lens=lens,
        extend_seq_lens=lens, extend_prefix_lens=[0] * n,
    )  # fmt: skip


def decode_batch(seqs: int, context: int, vocab: int) -> split.ForwardBatch:
    """A decode case: ``seqs`` sequences each at position ``context - 1``, sequence ``i``'s
    new row in slot ``i * context + context`` (its cached context: ``decode_prefix``)."""
    rows = np.arange(seqs)
    return split.ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=seqs, input_ids=rows % vocab,
        positions=np.full(seqs, context - 1), out_cache_loc=rows * context + context,
        req_pool_indices=rows, seq_lens=np.full(seqs, context),
    )  # fmt: skip


def decode_prefix(batch: split.ForwardBatch) -> split.ForwardBatch:
    """The cached context of a ``decode_batch``: positions ``0 .. context - 2`` of each
    sequence in its own slots (``row * context + 1 + position``), recorded in the page table
    and never run. Without it those positions map to the padding slot 0, which every padding
    row of a step writes: a TBO step (whose children have padding rows) then attended over
    different keys than the plain step, and its routing collapsed (nearly all of a
    micro-batch's tokens on one expert, where the plain step's load was spread)."""
    seqs, context = batch.batch_size, int(batch.seq_lens[0])
    prefix = context - 1
    slots = np.arange(seqs)[:, None] * context + 1 + np.arange(prefix)[None, :]
    return split.ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=seqs,
        input_ids=np.zeros(seqs * prefix, np.int32),
        positions=np.tile(np.arange(prefix), seqs), out_cache_loc=slots.reshape(-1),
        req_pool_indices=np.arange(seqs), seq_lens=np.full(seqs, prefix),
        extend_seq_lens=np.full(seqs, prefix), extend_prefix_lens=np.zeros(seqs, np.int64),
    )  # fmt: skip


PhasesAndRest = tuple[step_phases.StepPhases, float]
"""Medians of a step's host phases and of the seconds of each step outside them."""


def time_interleaved(steps, iters: int) -> tuple[list[float], list[PhasesAndRest]]:
    """Median seconds of each ``(runner, plan)`` step, and per step the medians of its host
    phases and of the rest of its time (``_median_phases``), the steps taking turns ``iters``
    times (after two warm-up runs each, which also absorb EP re-runs): a drift of the machine
    (clocks, a neighbour) then moves every column alike instead of one."""
    for runner, plan in steps:
        for _ in range(2):
            runner.run_plan(plan).block_until_ready()
    times, phases = [[] for _ in steps], [[] for _ in steps]
    for _ in range(iters):
        for column, phase, (runner, plan) in zip(times, phases, steps, strict=True):
            start = time.perf_counter()
            runner.run_plan(plan).block_until_ready()
            column.append(time.perf_counter() - start)
            phase.append(runner.last_step_phases)
    medians = [statistics.median(column) for column in times]
    return medians, [_median_phases(*timed) for timed in zip(times, phases, strict=True)]


DEVICE_ITERS = 10
"""Steps enqueued back to back per timed run of ``back_to_back_ms``."""


def back_to_back_ms(runner, plan) -> float:
    """The devices' milliseconds per step: ``runner.run_token_plan(plan)`` enqueued
    ``DEVICE_ITERS`` times back to back, the host's work hidden under the devices' (median of
    three such runs, after a warm-up)."""
    jax.block_until_ready(runner.run_token_plan(plan))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(DEVICE_ITERS):
            out = runner.run_token_plan(plan)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / DEVICE_ITERS * 1e3)
    return statistics.median(times)


def _median_phases(times: list[float], phases: list[step_phases.StepPhases]) -> PhasesAndRest:
    """``(StepPhases medians, median seconds of each step outside its phases)``."""
    rest = statistics.median(t - p.total for t, p in zip(times, phases, strict=True))
    return step_phases.median_phases(phases), rest


def case_plan(runner, batches, tbo: bool, logits: str):
    """The plan of a case's per-rank batches (recorded first), TBO on or off, computing the
    ``logits`` rows ("last": each sequence's last one, as ``generate`` serves; "all")."""
    for rank, batch in enumerate(batches):
        if batch.forward_mode.is_decode() and batch.seq_lens[0] > 1:
            runner.record(rank, decode_prefix(batch))
        runner.record(rank, batch)
    options = dataclasses.replace(runner.runner_config.plan, enable_tbo=tbo)
    plan = planning.plan_step(list(batches), options, logits=logits)
    if tbo and plan.child_capacity is None:
        raise ValueError(
            f"{batches[0].forward_mode.name} batches of {_tokens(batches)} cannot run TBO"
        )
    return plan


def _tokens(batches) -> str:
    """Tokens per rank of a case: one number when the ranks are equal, else one per rank."""
    counts = [str(batch.num_tokens) for batch in batches]
    return counts[0] if len(set(counts)) == 1 else "/".join(counts)


def _rank_logits(logits, batches, mode: str) -> np.ndarray:
    """Every rank's real rows of a step's ``[dp, rows, vocab]`` logits, rank after rank
    (``mode`` "all": its tokens; "last": its sequences)."""
    logits = np.asarray(logits)
    counts = [b.num_tokens if mode == "all" else len(last_rows.last_rows(b)) for b in batches]
    return np.concatenate([logits[r, :count] for r, count in enumerate(counts)])


def prefill_batches(tokens: int, args, vocab: int) -> tuple[split.ForwardBatch, ...]:
    """A prefill case: ``tokens`` on rank 0 and ``--prefill-skew`` times as many on the others."""
    others = max(1, round(tokens * args.prefill_skew))
    return tuple(
        _prefill_batch(tokens if rank == 0 else others, args.prompt_len, vocab)
        for rank in range(args.dp)
    )


PROFILE_STEPS = 3
"""Steps each trace holds."""


def _dump_flags(directory: str) -> list[str]:
    """XLA flags that dump the optimized HLO of every model step into ``directory/hlo`` (read
    by ``kernel_time``); they take effect only before the first backend use."""
    return [f"--xla_dump_to={directory}/hlo", "--xla_dump_hlo_module_re=model_step"]


EXCHANGE_KINDS = ("all-to-all", "ragged-all-to-all", hlo_schedule.PEER_COPY_KIND)
"""Collective kinds of the EP exchange (dispatch and combine)."""
COLUMNS = ("no TBO", "TBO")
"""The traced columns, in the order ``_trace_case`` returns them."""
OVERLAP_FOOTNOTES = (
    "NCCL under compute: share of the NCCL kernels' (or peer copies') time during which a "
    "compute kernel ran on the same GPU; compute / communication ms: busy time per GPU and step.",
    "step: the measured median step time of the timing table, not the trace's span: traces "
    "leave out kernels of loops recorded into CUDA graphs, which shows as gaps.",
    "bytes/exchange: mean bytes of one EP all-to-all (dispatch or combine) per device; GB/s: "
    "per GPU, bytes sent through NCCL or peer copies / their busy time (every collective of "
    "the compiled step).",
)


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """One traced step program."""

    kernels: tuple[kernel_time.Kernel, ...]  # the step module's kernels, PROFILE_STEPS steps
    hlo_text: str  # that module's optimized HLO


@dataclasses.dataclass(frozen=True)
class OverlapRow:
    """What one column of one case hid (a row of ``overlap_table``)."""

    case: str  # e.g. "prefill 4096"
    column: str  # "no TBO" or "TBO"
    hidden_share: float | None  # NCCL time under compute / NCCL time; None: no NCCL kernels
    compute_ms: float  # compute busy time per GPU and step
    communication_ms: float  # NCCL busy time per GPU and step
    step_ms: float  # the measured median step time
    bytes_per_exchange: float | None  # mean bytes of one all-to-all per device; None: none
    # collective bytes / NCCL busy time; None: no NCCL time, or no collective in the HLO
    gigabytes_per_second: float | None

    @property
    def bound_ratio(self) -> float:
        """Step time over ``max(compute, communication)``, what perfect overlap could reach."""
        return self.step_ms / max(self.compute_ms, self.communication_ms)


def overlap_row(
    case: str, column: str, kernels: list[kernel_time.Kernel], steps: int, step_seconds: float,
    collectives: dict[str, list[int]],
) -> OverlapRow:  # fmt: skip
    """What a traced step hid, from its kernels and its compiled collectives.

    Args:
      case: the case's name, e.g. "prefill 4096".
      column: "no TBO" or "TBO".
      kernels: the step module's kernels over ``steps`` steps, on every GPU.
      steps: how many steps the kernels hold.
      step_seconds: the measured median step time.
      collectives: ``kernel_time.collective_bytes`` of the step's optimized HLO.

    Returns:
      The ``OverlapRow``.

    Raises:
      ValueError: no kernels, or fewer on a GPU than ``steps`` (``kernel_time.busy_times``).
    """
    busy = kernel_time.busy_times(kernels, steps)
    hidden, total = kernel_time.hidden_communication(kernels)
    exchanges = [size for kind in EXCHANGE_KINDS for size in collectives.get(kind, [])]
    step_bytes = sum(sum(sizes) for sizes in collectives.values())
    return OverlapRow(
        case=case, column=column, hidden_share=hidden / total if total else None,
        compute_ms=busy.compute / 1e3, communication_ms=busy.communication / 1e3,
        step_ms=step_seconds * 1e3,
        bytes_per_exchange=statistics.mean(exchanges) if exchanges else None,
        # bytes per microsecond are MB/s
        gigabytes_per_second=(
            step_bytes / busy.communication / 1e3 if busy.communication and step_bytes else None
        ),
    )  # fmt: skip


def overlap_table(rows: list[OverlapRow]) -> str:
    """The overlap table of ``bench tbo``.

    Args:
      rows: one ``OverlapRow`` per case and column.

    Returns:
      A markdown table, a blank line and the footnotes that define its columns.
    """
    lines = [
        "| case | column | NCCL under compute | compute ms | communication ms "
        "| step / max(compute, comm) | bytes/exchange | GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_overlap_line(row) for row in rows]
    return "\n".join(lines + ["", *OVERLAP_FOOTNOTES])


def _overlap_line(row: OverlapRow) -> str:
    hidden = "-" if row.hidden_share is None else f"{row.hidden_share:.3f}"
    exchange = "-" if row.bytes_per_exchange is None else _format_bytes(row.bytes_per_exchange)
    rate = "-" if row.gigabytes_per_second is None else f"{row.gigabytes_per_second:.2f}"
    return (
        f"| {row.case} | {row.column} | {hidden} | {row.compute_ms:.2f} | "
        f"{row.communication_ms:.2f} | {row.bound_ratio:.3f} | {exchange} | {rate} |"
    )


def _format_bytes(size: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


def _trace(runner, plan, folder: str) -> str:
    """Traces ``PROFILE_STEPS`` steps of a plan (after one untraced run) into ``folder``.

    Returns:
      The new ``*.trace.json.gz`` (a folder traced before keeps its older traces).

    Raises:
      ValueError: the trace did not write exactly one new trace file.
    """
    pattern = f"{folder}/**/*.trace.json.gz"
    before = set(glob.glob(pattern, recursive=True))
    runner.run_plan(plan).block_until_ready()
    with jax.profiler.trace(folder):
        for _ in range(PROFILE_STEPS):
            runner.run_plan(plan).block_until_ready()
    written = sorted(set(glob.glob(pattern, recursive=True)) - before)
    if len(written) != 1:
        raise ValueError(f"{len(written)} new trace files in {folder}, expected one")
    return written[0]


def _trace_case(runner, batches, directory: str, name: str, logits: str) -> list[str]:
    """Trace files of the plain and the TBO step (``directory/{name}_plain``, ``_tbo``)."""
    return [
        _trace(
            runner,
            case_plan(runner, batches, tbo, logits),
            f"{directory}/{name}_{'tbo' if tbo else 'plain'}",
        )
        for tbo in (False, True)
    ]


def _step_trace(trace_path: str, dump_dir: str) -> StepTrace:
    """The kernels of a trace's step module (``kernel_time.step_module``) and its HLO."""
    kernels = kernel_time.gpu_kernels(kernel_time.read_trace(trace_path))
    module = kernel_time.step_module(kernels)
    mine = tuple(kernel for kernel in kernels if kernel.module == module)
    return StepTrace(mine, kernel_time.hlo_dump_of(dump_dir, module))


def _print_per_operation(case: str, traces: list[StepTrace]) -> None:
    """A case's kernel time per operation, plain against TBO, then each column's largest
    kernels with their operation."""
    plain, tbo = (kernel_time.attribute(list(t.kernels), t.hlo_text, PROFILE_STEPS) for t in traces)
    print(f"\n{case}: GPU kernel time per step by operation")
    print(kernel_time.compare_table(plain, tbo))
    for column, trace in zip(COLUMNS, traces, strict=True):
        print(f"\n{case}, {column}: the largest kernels per step and their operation")
        table = kernel_time.largest_kernels_table(
            list(trace.kernels), trace.hlo_text, PROFILE_STEPS
        )
        print(table)


def _case_overlap(
    runner, case, seconds, directory: str, per_operation: bool, logits: str
) -> list[OverlapRow]:
    """Traces a case's plain and TBO steps on a GPU and returns their ``OverlapRow``s;
    ``per_operation`` also prints their kernel time per model operation."""
    name, size, batches = case
    traces = [
        _step_trace(path, f"{directory}/hlo")
        for path in _trace_case(runner, batches, directory, f"{name}_{size}", logits)
    ]
    if per_operation:
        _print_per_operation(f"{name} {size}", traces)
    return [
        overlap_row(
            f"{name} {size}",
            column,
            list(trace.kernels),
            PROFILE_STEPS,
            step_seconds,
            kernel_time.collective_bytes(trace.hlo_text),
        )
        for column, trace, step_seconds in zip(COLUMNS, traces, seconds, strict=True)
    ]


def _report_overlap(
    runner, cases, step_times, directory: str, per_operation: bool, on_gpu: bool, logits: str
) -> None:
    """Traces every case and prints the overlap table; without a GPU, one line (no NCCL
    kernels) and, for ``--profile DIR`` (``per_operation``), the traces alone."""
    if not on_gpu:
        print("\noverlap table: needs a GPU (the CPU trace has no NCCL kernels)")
        if per_operation:  # --profile DIR: the traces are still written, to be read by hand
            for name, size, batches in cases:
                _trace_case(runner, batches, directory, f"{name}_{size}", logits)
        return
    rows = []
    for case, seconds in zip(cases, step_times, strict=True):
        rows += _case_overlap(runner, case, seconds[:2], directory, per_operation, logits)
    print(f"\nWhat was hidden (traces and HLO in {directory}):\n{overlap_table(rows)}")


def _case(
    runners, auto, batches, iters: int, logits: str
) -> tuple[list[float], list[PhasesAndRest], str, tbo_auto.TboDecision]:
    """Seconds per step (plain, TBO, then TBO on each further runner, e.g. with barriers, and
    last the "auto" runner's chosen step), the host phases of each (``time_interleaved``),
    how the first TBO step's logits compare with the plain step's (``_agreement``), and the
    auto runner's decision."""
    steps = [(runners[0], case_plan(runners[0], batches, False, logits))]
    steps += [(runner, case_plan(runner, batches, True, logits)) for runner in runners]
    auto_plan, decision = _auto_plan(auto, batches, logits)
    times, phases = time_interleaved(steps + [(auto, auto_plan)], iters)
    want, got = (_rank_logits(runner.run_plan(plan), batches, logits) for runner, plan in steps[:2])
    return times, phases, _agreement(got, want), decision


def _auto_plan(runner, batches, logits: str) -> tuple[planning.StepPlan, tbo_auto.TboDecision]:
    """An "auto" runner's plan of the case after its first step of the shape decided it."""
    # case_plan also records the batches (and decode contexts).
    tbo_plan = case_plan(runner, batches, True, logits)
    runner.forward(list(batches), logits=logits)  # times both programs, keeps the faster
    shape = tbo_auto.TboShape(tbo_plan.capacity, tbo_plan.mode)
    decision = {d.shape: d for d in runner.tbo_decisions()}[shape]
    return (tbo_plan if decision.use_tbo else case_plan(runner, batches, False, logits)), decision


def _agreement(got: np.ndarray, want: np.ndarray) -> str:
    """Median over rows of ``max |got - want| / max |want|``, and the share of rows whose
    greedy token agrees. The two programs round differently (merged matmuls, other GEMM
    tilings; bf16, and TF32 for float32 dots on a GPU), and a routing near-tie can then pick
    another expert for a few tokens, so a few rows may differ by far more than the median."""
    rows = np.abs(got - want).max(axis=-1) / np.abs(want).max()
    same = np.mean(got.argmax(axis=-1) == want.argmax(axis=-1))
    return f"{np.median(rows):.1e} / {same:.3f}"


def _runner(model, mesh, args, largest: int, barriers: bool, tbo: bool | str = False, shared=None):
    moe = layer_ops.MoEOptions(
        moe_a2a_backend=args.moe_a2a_backend, moe_runner_backend=args.moe_runner_backend,
        moe_runner_backend_tbo=args.moe_runner_backend_tbo,
        ep_capacity_factor=args.ep_capacity_factor, ep_overflow_policy=args.ep_overflow_policy,
        ep_exchange=args.ep_exchange, ep_exchange_tbo=args.ep_exchange_tbo, ep_dedup=args.ep_dedup,
    )  # fmt: skip
    return runner_lib.ModelRunner(
        model, mesh, moe=moe,
        tbo=tbo_options.TboOptions(
            enable_two_batch_overlap=tbo, tbo_round_barriers=barriers,
            tbo_child_buckets=args.tbo_child_buckets,
        ),
        max_total_tokens=largest + 1,
        max_running_requests=max(args.decode + [largest // args.prompt_len + 1]),
        token_buckets=sorted(set(args.prefill + args.decode)), dtype=jnp.dtype(args.dtype),
        attention_backend=args.attention_backend, dp_padding=args.dp_padding,
        ep_routing_stats=_measured_stats(args), params_from=shared,
    )  # fmt: skip


def _measured_stats(args) -> str | None:
    """``--ep-routing-stats`` when the file exists (a first run writes it), else None."""
    path = args.ep_routing_stats
    return path if path is not None and os.path.exists(path) else None


def _save_routing_stats(args, runners) -> None:
    """Writes every runner's measured EP peak loads, merged, to ``--ep-routing-stats``."""
    peaks = ep_dispatchers.merge_peaks(*(runner.ep_routing_stats() for runner in runners))
    ep_stats_file.save(args.ep_routing_stats, runners[0].ep_routing_model(), peaks)
    print(f"EP routing statistics ({len(peaks)} dispatch sizes) -> {args.ep_routing_stats}")


def bench_config(args) -> config_lib.MoEConfig:
    """The benchmark's model: ``--hf-config`` (cut to ``--num-layers``), or a preset that
    ``--tiny`` / ``--attention-kind`` pick among four; ``--expert-dtype`` its routed experts'
    storage.

    Raises:
      ValueError: ``--num-layers`` without ``--hf-config``, or ``--hf-config`` beside
        ``--tiny`` / ``--attention-kind`` (names both); an unsupported config.
    """
    stored = config_lib.resolve_expert_dtype(args.expert_dtype, args.dtype)
    if args.hf_config is None:
        if args.num_layers is not None:
            raise ValueError("--num-layers applies to --hf-config only")
        presets = {
            (False, "mla"): config_lib.MoEConfig.deepseek_v3_reduced,
            (False, "gqa"): config_lib.MoEConfig.deepseek_v3_gqa_reduced,
            (True, "mla"): config_lib.MoEConfig.tiny_mla,
            (True, "gqa"): config_lib.MoEConfig.tiny,
        }
        preset = presets[args.tiny, args.attention_kind or "mla"]
        return dataclasses.replace(preset(), expert_dtype=stored)
    if args.tiny or args.attention_kind is not None:
        flag = "--tiny" if args.tiny else "--attention-kind"
        raise ValueError(f"--hf-config {args.hf_config} sets the model: {flag} does not apply")
    config = hf_configs.moe_config(hf_configs.read_layers(args.hf_config, args.num_layers))
    return dataclasses.replace(config, expert_dtype=stored)


def _kv_bytes(config: config_lib.MoEConfig, dtype: str) -> str:
    """KV-cache bytes per token (all layers, one DP rank, before the attn_tp split)."""
    per_token = limits.kv_bytes_per_token(config, jnp.dtype(dtype).itemsize)
    return f"attention {config.attention_kind}, KV cache {per_token} bytes/token"


def _print_limits(config: config_lib.MoEConfig, cases, step_times, args) -> None:
    """One line per case: its physical limit against the plain step (``jtbo.bench.limits``),
    the rates measured here, after the timing (rank 0's batch: the busiest)."""
    if args.attn_tp != 1:
        print("physical limit: computed for attn_tp 1 only")
        return
    on_gpu = jax.devices()[0].platform == "gpu"
    names = {name for name, _, _ in cases}  # each rate measured once, where a case needs it
    if "prefill" in names:
        matmul = device_rates.matmul_tflops(8192 if on_gpu else 256, iters=10, reps=3)
    if "decode" in names:
        copy = device_rates.copy_gbs(1 << 30 if on_gpu else 1 << 20, iters=10, reps=3)
    itemsize = jnp.dtype(args.dtype).itemsize
    for (name, size, batches), (plain, _, device) in zip(cases, step_times, strict=True):
        batch = batches[0]
        if name == "prefill":
            flops = limits.prefill_flops(config, [int(n) for n in batch.extend_seq_lens])
            limit = limits.Limit(flops, "TFLOP", matmul, "bf16 matmul")
        else:
            context = int(np.sum(batch.seq_lens))
            traffic = limits.decode_bytes(config, context, args.dp * args.attn_tp, itemsize)
            limit = limits.Limit(traffic, "GB", *copy)
        print(f"physical limit, {name} {size}: {limit.describe(plain * 1e3, device)}")


def _header(args) -> str:
    """The line above the timing table: devices, layout, link, extra XLA options."""
    options = " ".join(f"--{name}={_flag_value(value)}" for name, value in args.xla_option)
    return (
        f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}; dp={args.dp}, "
        f"attn_tp={args.attn_tp}; MoE {args.moe_a2a_backend}"
        f"{f' {args.ep_exchange}' if args.moe_a2a_backend == 'ep' else ''}"
        f"{f' (TBO {args.ep_exchange_tbo})' if args.ep_exchange_tbo else ''}"
        f"{' dedup' if args.ep_dedup and args.moe_a2a_backend == 'ep' else ''}"
        f"{'' if args.moe_a2a_backend == 'ep' else f', DP padding {args.dp_padding}'}"
        f"{'' if args.prefill_skew == 1 else f', prefill skew {args.prefill_skew}'}, experts "
        f"{args.moe_runner_backend}; attention {args.attention_backend}; link {args.link}; "
        f"jax {jax.__version__}" + (f"; XLA_FLAGS += {options}" if options else "")
    )


def _time_cases(runners, auto, cases, args) -> list[tuple[float, float, float | None]]:
    """Prints the timing table; returns each case's (plain, TBO) median seconds and, where the
    step computes the last rows' logits (``--logits last``), the plain step's device time in
    milliseconds (``back_to_back_ms``; else None)."""
    extra = " TBO+barriers (ms) | ratio |" if args.barriers else ""
    print(
        "| case | tokens/rank | no TBO (ms) | TBO (ms) | TBO / no TBO |"
        + extra
        + " auto (ms) | auto / min | auto chose |"
        + " Δ logits (median row) / same token | numerics guard (ms) |"
    )
    print("|---|---|---|---|---|" + ("---|---|" if args.barriers else "") + "---|---|---|---|---|")
    step_times, child_rows, fills, paddings, phase_lines = [], [], [], [], []
    for name, size, batches in cases:
        (plain, *tbo_times, auto_time), phases, agreement, decision = _case(
            runners, auto, batches, args.iters, args.logits
        )
        phase_lines += [
            _phase_line(f"{name} {size}", column, step_time, *step_phases_and_rest)
            for column, step_time, step_phases_and_rest in zip(
                ("no TBO", "TBO"), (plain, tbo_times[0]), phases[:2], strict=True
            )
        ]
        cells = "".join(f" {t * 1e3:.2f} | {t / plain:.3f} |" for t in tbo_times)
        guard = _guard_time(runners[0], batches, args.iters, args.logits)
        plan_plain = case_plan(runners[0], batches, False, args.logits)
        print(f"| {name} {size} | {_tokens(batches)} | {plain * 1e3:.2f} |{cells}"
              f"{_auto_cells(auto_time, plain, tbo_times[0], decision)} {agreement} | "
              f"{guard * 1e3:.3f} |", flush=True)  # fmt: skip
        device = None if args.logits != "last" else back_to_back_ms(runners[0], plan_plain)
        step_times.append((plain, tbo_times[0], device))
        rows, fill = _tbo_rows_and_fill(runners[0], batches, args.logits)
        child_rows.append(f"{name} {size}: {rows}")
        fills.append(f"{name} {size}: {fill}")
        paddings.append(f"{name} {size}: {_dp_padding(runners[0], batches)}")
    print("TBO micro-batch rows (child capacity of the bucket): " + "; ".join(child_rows))
    if args.moe_a2a_backend == "ep":
        print("EP buffer fill of the TBO step, peak / capacity per micro-batch (peer / expert): "
              + "; ".join(fills))  # fmt: skip
    else:
        print("DP gather of the plain step (mode, buffer rows): " + "; ".join(paddings))
    print("\n".join(["", *PHASE_HEADER, *phase_lines, "", PHASE_FOOTNOTE]))
    return step_times


PHASE_HEADER = (
    "| case | column | inputs (ms) | dispatch (ms) | until the EP counts (ms) | rest (ms) | "
    "step (ms) |",
    "|---|---|---|---|---|---|---|",
)
PHASE_FOOTNOTE = (
    "Host phases of a step (ModelRunner.last_step_phases, medians over the timed steps): "
    "inputs = packing the plan (its page-table writes too) and issuing its transfers; "
    "dispatch = the jitted call until it returned; until the EP counts = from then until the "
    "overflow counts were on the host (the devices' remaining work and the read-back); rest = each "
    "step's time less the three (the wait for the logits and the bench's own calls)."
)


def _phase_line(case: str, column: str, step_time: float, phases, rest: float) -> str:
    """One row of the host-phase table: the medians of a step's phases (``StepPhases``), of
    the rest of its time and of its time."""
    cells = (phases.inputs, phases.dispatch, phases.counts, rest, step_time)
    return f"| {case} | {column} | " + " | ".join(f"{t * 1e3:.3f}" for t in cells) + " |"


def _dp_padding(runner, batches) -> str:
    """The DP padding mode and gathered-buffer rows of the plain step of ``batches``."""
    plan = planning.plan_step(
        list(batches), dataclasses.replace(runner.runner_config.plan, enable_tbo=False)
    )
    context = plan.replicated.dp_context
    return f"{context.padding_mode.name} {context.global_buffer_len}"


def _tbo_rows_and_fill(runner, batches, logits: str) -> tuple[str, str]:
    """One TBO step of ``batches``: its micro-batch rows (``"2048 of 4096"``: the child capacity
    the plan took, of the bucket) and ``peer / expert`` peak-over-capacity per micro-batch."""
    plan = case_plan(runner, batches, True, logits)
    runner.run_plan(plan)
    fill = ", ".join(f"{peer:.2f} / {expert:.2f}" for peer, expert in runner.ep_buffer_fill())
    return f"{plan.child_capacity} of {plan.capacity}", fill


def _guard_time(runner, batches, iters: int, logits: str) -> float:
    """Median seconds the runner's numerics guard adds to a step of ``batches``: the on-device
    finiteness flags of the plain step's logits and their read-back (``numerics``; what
    ``ModelRunner(check_finite_logits=False)`` saves)."""
    out = runner.run_plan(case_plan(runner, batches, False, logits))
    np.asarray(numerics.finite_rows(out))  # compiled before timing
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        np.asarray(numerics.finite_rows(out))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _auto_cells(auto_time: float, plain: float, tbo: float, decision) -> str:
    """The auto columns: its time, that over ``min(plain, TBO)``, its choice and measured
    TBO / plain ratio."""
    choice = "TBO" if decision.use_tbo else "plain"
    return (
        f" {auto_time * 1e3:.2f} | {auto_time / min(plain, tbo):.3f} | "
        f"{choice} ({decision.ratio:.2f}x) |"
    )


def bench_cases(args, vocab: int) -> list[tuple[str, int, tuple[split.ForwardBatch, ...]]]:
    """The cases the flags ask for, in order: ``(mode, size, per-rank batches)``, prefill
    (``prefill_batches``) then decode (``decode_batch`` on every rank)."""
    cases = [("prefill", n, prefill_batches(n, args, vocab)) for n in args.prefill]
    cases += [("decode", s, (decode_batch(s, args.context, vocab),) * args.dp) for s in args.decode]
    return cases


def bench_runners(args, config, auto: bool = True) -> tuple[list, runner_lib.ModelRunner | None]:
    """The plain / TBO runner and, with ``--barriers``, one with round barriers; and the
    "auto" runner (None with ``auto=False``: a caller that times no "auto" step builds no
    third KV pool)."""
    mesh = mesh_lib.make_mesh(args.dp, args.attn_tp)
    largest = max(args.prefill + [s * args.context for s in args.decode] + [1])
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    first = _runner(model, mesh, args, largest, False)
    # The other runners read the first one's device parameters: one copy of the weights.
    runners = [first] + (
        [_runner(model, mesh, args, largest, True, shared=first)] if args.barriers else []
    )
    if not auto:
        return runners, None
    return runners, _runner(model, mesh, args, largest, False, tbo="auto", shared=first)


def parse(argv) -> tuple[argparse.Namespace, config_lib.MoEConfig]:
    """The flags (``--devices N`` applied: dp N, attn_tp 1) and the model they name
    (``bench_config``); a bad model stops at parse with the reason."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = bench_config(args)
    except ValueError as error:
        parser.error(str(error))
    if args.devices is not None:
        args.dp, args.attn_tp = args.devices, 1
    return args, config


def main(argv) -> None:
    """Runs the benchmark and prints the tables (see the module docstring).

    Raises:
      ValueError: ``--env`` clashes with ``--link`` (``configure_environment``).
    """
    args, config = parse(argv)
    directory = None if args.no_profile else args.profile or tempfile.mkdtemp(prefix="jtbo_tbo_")
    configure_environment(args, os.environ, directory)  # before anything starts the backend
    runners, auto = bench_runners(args, config)
    args.moe_runner_backend = runners[
        0
    ].runner_config.parallel.moe.moe_runner_backend  # as resolved
    args.attention_backend = runners[0].runner_config.parallel.attention_backend
    print(_header(args) + "; " + _kv_bytes(config, args.dtype))
    cases = bench_cases(args, config.vocab_size)
    step_times = _time_cases(runners, auto, cases, args)
    _print_limits(config, cases, step_times, args)
    if args.ep_routing_stats is not None:
        _save_routing_stats(args, [*runners, auto])
    # Traces come after every timing: a trace may leave the profiler's per-kernel hooks in
    # place, and the TBO step has more kernels, so timing after a trace would tilt the
    # TBO / no TBO ratio.
    if directory is not None:
        on_gpu = jax.devices()[0].platform == "gpu"
        _report_overlap(
            runners[0], cases, step_times, directory, bool(args.profile), on_gpu, args.logits
        )
