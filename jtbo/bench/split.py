"""Host cost of TBO planning + ``split_batch`` per step: ``python -m jtbo.bench split``.

For 256-sequence EXTEND and DECODE batches (random lengths, fixed seed) it times, per step,
the split planning (``compute_split_seq_index`` + ``compute_split_token_index``), attaching the
split index to the batch, and ``split_batch``; it prints the median and 90th percentile in
microseconds over many runs. Target: <= 100 us per step (docs/benchmarks/, "Host planning").
"""

import argparse
import statistics
import time

import numpy as np

from jtbo.core import cli_arguments
from jtbo.split import batch as batch_lib
from jtbo.split import children as children_lib
from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode


def _extend_batch(rng: np.random.Generator, num_seqs: int) -> batch_lib.ForwardBatch:
    lens = rng.integers(1, 512, num_seqs).astype(np.int32)
    prefix = rng.integers(0, 2048, num_seqs).astype(np.int32)
    n = int(lens.sum())
    positions = np.concatenate([p + np.arange(k) for k, p in zip(lens, prefix, strict=True)])
    return batch_lib.ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=num_seqs,
        input_ids=rng.integers(0, 32000, n).astype(np.int32),
        positions=positions.astype(np.int32),
        out_cache_loc=rng.integers(0, 1 << 20, n).astype(np.int32),
        req_pool_indices=np.arange(num_seqs, dtype=np.int32),
        seq_lens=prefix + lens,
        extend_seq_lens=lens,
        extend_prefix_lens=prefix,
    )


def _decode_batch(rng: np.random.Generator, num_seqs: int) -> batch_lib.ForwardBatch:
    seq_lens = rng.integers(1, 4096, num_seqs).astype(np.int32)
    return batch_lib.ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=num_seqs,
        input_ids=rng.integers(0, 32000, num_seqs).astype(np.int32),
        positions=seq_lens - 1,
        out_cache_loc=rng.integers(0, 1 << 20, num_seqs).astype(np.int32),
        req_pool_indices=np.arange(num_seqs, dtype=np.int32),
        seq_lens=seq_lens,
    )


def plan_and_split(batch: batch_lib.ForwardBatch, attn_tp_size: int):
    """One step of host work: plan the split, attach it, split the batch.

    Args:
      batch: a host batch without a split index.
      attn_tp_size: attention TP size for the children's padded lengths.

    Returns:
      ``(child_a, child_b)``.
    """
    planned = children_lib.plan_tbo_split(batch)
    return children_lib.split_batch(planned, attn_tp_size=attn_tp_size)


def _time_us(fn, runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return samples


def main(argv: list[str]) -> None:
    """Prints a table of per-step host planning + split cost.

    Args:
      argv: ``[--runs N] [--seqs N] [--attn-tp N] [--seed N]``.
    """
    parser = argparse.ArgumentParser(prog="python -m jtbo.bench split")
    parser.add_argument("--runs", type=cli_arguments.positive_int, default=2000)
    parser.add_argument("--seqs", type=cli_arguments.positive_int, default=256)
    parser.add_argument("--attn-tp", type=cli_arguments.positive_int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(
        f"host TBO planning + split_batch, {args.seqs} sequences, {args.runs} runs, target 100 us"
    )
    print(f"{'mode':<8} {'tokens':>8} {'median us':>10} {'p90 us':>8} {'target':>7}")
    for name, make in (("EXTEND", _extend_batch), ("DECODE", _decode_batch)):
        batch = make(rng, args.seqs)
        for _ in range(50):  # warm caches and numpy dispatch
            plan_and_split(batch, args.attn_tp)
        samples = _time_us(lambda b=batch: plan_and_split(b, args.attn_tp), args.runs)
        median = statistics.median(samples)
        p90 = statistics.quantiles(samples, n=10)[-1]
        verdict = "ok" if median <= 100 else "MISSED"
        print(f"{name:<8} {batch.num_tokens:>8} {median:>10.1f} {p90:>8.1f} {verdict:>7}")
