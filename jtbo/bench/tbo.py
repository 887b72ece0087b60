"""``python -m jtbo.bench tbo``: step time with two-batch overlap vs without, one device group.

TBO's cost when there is nothing to hide: on one H200 the step has no communication, so TBO
can only lose (two half-size micro-batches, split/merge copies). The model is DeepSeek-V3's
hidden size and expert shape reduced to fit (``MoEConfig.deepseek_v3_reduced``: hidden 7168,
64 experts, top-8 + 1 shared, 4 layers, bf16). Cases: prefill of 4096-16384 tokens per DP rank
(prompts of ``--prompt-len`` tokens) and decode of 64-256 sequences (context ``--context``).
For each case one ``ModelRunner`` plans the same batch twice (TBO on and off) and runs the two
jitted steps in turn; the time is the median of ``--iters`` runs after warm-up,
device-synchronised, without host planning or copying logits back. Decode sequences have
their cached context in their own KV slots (``_decode_prefix``). The last column compares the
TBO step's logits with the plain step's (``_agreement``; ``--dtype float32`` takes bf16
rounding out). Prints a markdown table (target: ratio <= 1.05 at prefill >= 4096 tokens and
decode >= 128 sequences). ``--devices N`` runs DP attention over N devices (dp=N, EP over all
of them: the multi-GPU measurement of issue 8), and ``--barriers`` adds a column for TBO with
round barriers (a second runner); ``--profile DIR`` traces plain and TBO steps of the first
prefill and decode case (``jax.profiler``, with the optimized HLO dumped beside them) and
prints, on a GPU, their kernel time per model operation (``jtbo.bench.kernel_time``).
"""

import argparse
import dataclasses
import glob
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo import split
from jtbo.bench import kernel_time
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import model as model_lib
from jtbo.runner import planning
from jtbo.runner import runner as runner_lib

ForwardMode = split.ForwardMode


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jtbo.bench tbo", description=__doc__)
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096, 8192, 16384])
    parser.add_argument("--decode", type=int, nargs="*", default=[64, 128, 256])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--context", type=int, default=1024, help="decode KV length")
    parser.add_argument("--iters", type=int, default=15, help="timed steps per column")
    parser.add_argument("--devices", type=int, help="shorthand for --dp N --attn-tp 1")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--attn-tp", type=int, default=1)
    parser.add_argument("--moe-a2a-backend", choices=("ep", "none"), default="ep")
    parser.add_argument("--ep-capacity-factor", type=float, default=4.0)
    parser.add_argument(
        "--ep-overflow-policy", choices=("rerun", "raise"), default="rerun",
        help="a step that overflows EP capacity re-runs with the next bucket (warm-up absorbs it)",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="MoEConfig.tiny() (smoke test)")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16",
        help="parameter / activation dtype (float32: the agreement column without bf16 rounding)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", metavar="DIR",
        help="trace plain and TBO steps of the first prefill and decode case into DIR and "
        "print their GPU time per operation (jtbo.bench.kernel_time)",
    )  # fmt: skip
    parser.add_argument(
        "--barriers", action="store_true",
        help="also time TBO with round barriers (a second runner; column 'TBO+barriers')",
    )  # fmt: skip
    return parser


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


def _decode_batch(seqs: int, context: int, vocab: int) -> split.ForwardBatch:
    rows = np.arange(seqs)
    return split.ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=seqs, input_ids=rows % vocab,
        positions=np.full(seqs, context - 1), out_cache_loc=rows * context + context,
        req_pool_indices=rows, seq_lens=np.full(seqs, context),
    )  # fmt: skip


def _decode_prefix(batch: split.ForwardBatch) -> split.ForwardBatch:
    """The cached context of a ``_decode_batch``: positions ``0 .. context - 2`` of each
    sequence in its own slots (``row * context + 1 + position``), recorded in the page table
    and never run. Without it those positions map to the padding slot 0, which every padding
    row of a step writes: a TBO step (whose children have padding rows) then attended over
    different keys than the plain step, and its routing collapsed (61 of a micro-batch's 64
    tokens on one expert, where the plain step's busiest expert had 17 of 64)."""
    seqs, context = batch.batch_size, int(batch.seq_lens[0])
    prefix = context - 1
    slots = np.arange(seqs)[:, None] * context + 1 + np.arange(prefix)[None, :]
    return split.ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=seqs, input_ids=np.zeros(seqs * prefix),
        positions=np.tile(np.arange(prefix), seqs), out_cache_loc=slots.reshape(-1),
        req_pool_indices=np.arange(seqs), seq_lens=np.full(seqs, prefix),
        extend_seq_lens=np.full(seqs, prefix), extend_prefix_lens=np.zeros(seqs, np.int64),
    )  # fmt: skip


def _time_interleaved(steps, iters: int) -> list[float]:
    """Median seconds of each ``(runner, plan)`` step, the steps taking turns ``iters`` times
    (after two warm-up runs each, which also absorb EP re-runs): a drift of the machine (clocks,
    a neighbour) then moves every column alike instead of one."""
    for runner, plan in steps:
        for _ in range(2):
            runner.run_plan(plan).block_until_ready()
    times = [[] for _ in steps]
    for _ in range(iters):
        for column, (runner, plan) in zip(times, steps, strict=True):
            start = time.perf_counter()
            runner.run_plan(plan).block_until_ready()
            column.append(time.perf_counter() - start)
    return [statistics.median(column) for column in times]


def _plan(runner, batch, tbo: bool):
    batches = [batch] * runner.dp_size
    for rank in range(runner.dp_size):
        if batch.forward_mode.is_decode() and batch.seq_lens[0] > 1:
            runner.record(rank, _decode_prefix(batch))
        runner.record(rank, batch)
    plan = planning.plan_step(batches, dataclasses.replace(runner.options, enable_tbo=tbo))
    if tbo and plan.child_capacity is None:
        raise ValueError(f"{batch.forward_mode.name} batch of {batch.num_tokens} cannot run TBO")
    return plan


PROFILE_STEPS = 3
"""Steps each ``--profile`` trace holds."""


def _dump_step_hlo(directory: str) -> None:
    """Has XLA dump the optimized HLO of every model step into ``directory/hlo`` (read by
    ``kernel_time``); must run before the first backend use."""
    flags = f"--xla_dump_to={directory}/hlo --xla_dump_hlo_module_re=model_step"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


def _profile(runner, batch, directory: str, name: str) -> None:
    """Traces ``PROFILE_STEPS`` plain and TBO steps (``jax.profiler``, into
    ``directory/{name}_plain`` and ``_tbo``) and prints where their GPU time goes
    (``kernel_time.compare_table``; on a GPU only)."""
    traces = []
    for tbo in (False, True):
        plan = _plan(runner, batch, tbo)
        runner.run_plan(plan).block_until_ready()
        folder = f"{directory}/{name}_{'tbo' if tbo else 'plain'}"
        with jax.profiler.trace(folder):
            for _ in range(PROFILE_STEPS):
                runner.run_plan(plan).block_until_ready()
        traces.append(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))
    if jax.devices()[0].platform != "gpu":
        print(f"{name}: traces written; kernel attribution needs a GPU trace")
        return
    (plain, plain_lines), (tbo, tbo_lines) = (
        kernel_time.step_summary(found[0], f"{directory}/hlo", PROFILE_STEPS) for found in traces
    )
    print(
        f"\n{name}: GPU kernel time per step by operation\n{kernel_time.compare_table(plain, tbo)}"
    )
    for label, lines in (("no TBO", plain_lines), ("TBO", tbo_lines)):
        for line in lines:
            print(f"{name} {label}: {line}")


def _case(runners, batch, iters: int) -> tuple[list[float], str]:
    """Seconds per step (plain, TBO, then TBO on each further runner, e.g. with barriers) and
    how the first TBO step's logits compare with the plain step's (``_agreement``)."""
    steps = [(runners[0], _plan(runners[0], batch, False))]
    steps += [(runner, _plan(runner, batch, True)) for runner in runners]
    times = _time_interleaved(steps, iters)
    want, got = (
        np.asarray(runner.run_plan(plan))[:, : batch.num_tokens] for runner, plan in steps[:2]
    )
    return times, _agreement(got, want)


def _agreement(got: np.ndarray, want: np.ndarray) -> str:
    """Median over rows of ``max |got - want| / max |want|``, and the share of rows whose
    greedy token agrees. The two programs round differently (merged matmuls, other GEMM
    tilings; bf16, and TF32 for float32 dots on a GPU), and a routing near-tie can then pick
    another expert for a few tokens: measured on one H200 in float32, decode 128 and prefill
    4096 agreed to a median of 3e-4, with 2 / 128 and 13 / 4096 rows off by more than 5 %."""
    rows = np.abs(got - want).max(axis=-1) / np.abs(want).max()
    same = np.mean(got.argmax(axis=-1) == want.argmax(axis=-1))
    return f"{np.median(rows):.1e} / {same:.3f}"


def _runner(model, mesh, args, largest: int, barriers: bool):
    return runner_lib.ModelRunner(
        model, mesh, moe_a2a_backend=args.moe_a2a_backend, max_total_tokens=largest + 1,
        max_running_requests=max(args.decode + [largest // args.prompt_len + 1]),
        token_buckets=sorted(set(args.prefill + args.decode)), dtype=jnp.dtype(args.dtype),
        ep_capacity_factor=args.ep_capacity_factor, ep_overflow_policy=args.ep_overflow_policy,
        tbo_round_barriers=barriers,
    )  # fmt: skip


def main(argv) -> None:
    """Runs the benchmark and prints the table (see the module docstring)."""
    args = _parser().parse_args(argv)
    if args.profile:
        _dump_step_hlo(args.profile)
    if args.devices is not None:
        args.dp, args.attn_tp = args.devices, 1
    config = (
        config_lib.MoEConfig.tiny() if args.tiny else config_lib.MoEConfig.deepseek_v3_reduced()
    )
    mesh = mesh_lib.make_mesh(args.dp, args.attn_tp)
    largest = max(args.prefill + [s * args.context for s in args.decode] + [1])
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    runners = [_runner(model, mesh, args, largest, barriers=False)]
    if args.barriers:
        runners.append(_runner(model, mesh, args, largest, barriers=True))
    del model
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}; dp={args.dp}, "
          f"attn_tp={args.attn_tp}; MoE {args.moe_a2a_backend}; jax {jax.__version__}")  # fmt: skip
    extra = " TBO+barriers (ms) | ratio |" if args.barriers else ""
    print(
        "| case | tokens/rank | no TBO (ms) | TBO (ms) | TBO / no TBO |"
        + extra
        + " Δ logits (median row) / same token |"
    )
    print("|---|---|---|---|---|" + ("---|---|" if args.barriers else "") + "---|")
    vocab = config.vocab_size
    cases = [("prefill", n, _prefill_batch(n, args.prompt_len, vocab)) for n in args.prefill]
    cases += [("decode", s, _decode_batch(s, args.context, vocab)) for s in args.decode]
    for name, size, batch in cases:
        (plain, *tbo_times), agreement = _case(runners, batch, args.iters)
        cells = "".join(f" {t * 1e3:.2f} | {t / plain:.3f} |" for t in tbo_times)
        print(f"| {name} {size} | {batch.num_tokens} | {plain * 1e3:.2f} |{cells} "
              f"{agreement} |", flush=True)  # fmt: skip
    # Traces come after every timing: a trace may leave the profiler's per-kernel hooks in
    # place, and the TBO step has more kernels (on one H200, runs that timed decode after
    # tracing prefill measured decode-128 TBO / no TBO at 1.04-1.06, runs without at 1.03-1.04).
    profiled = set()
    for name, size, batch in cases:
        if args.profile and name not in profiled:
            _profile(runners[0], batch, args.profile, f"{name}_{size}")
            profiled.add(name)
