"""Compiling a runner's steps before serving (``ModelRunner.warmup``).

Each requested (token count, mode, sequence count) runs a synthetic step: rank 0 busy, the
other ranks idle, with the static keys a real step of that many tokens in that mode has. Its
K/V writes target the padding slot (dropped), so the warm-up leaves the pools as they were. An
"auto" runner compiles both the plain and the TBO program of each; a TBO step compiles at each
of its bucket's child capacities from its own up (``planning.child_capacities``), since a real
step's split picks one of them. With ``dp_padding="auto"`` the programs are MAX_LEN's (those of
steps whose ranks are equal).
"""

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jtbo import split
from jtbo.models import step_io
from jtbo.runner import planning, runner_config, step_engine, token_step

ForwardMode = split.ForwardMode
OUTPUTS = ("logits", "tokens")


def check_arguments(config: runner_config.RunnerConfig, seq_counts, outputs: str) -> None:
    """Raises ValueError for an unknown ``outputs`` or a sequence count outside
    ``[1, max_running_requests]``."""
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs must be 'logits' or 'tokens', got {outputs!r}")
    bad = [s for s in seq_counts if not 1 <= s <= config.max_running_requests]
    if bad:
        raise ValueError(
            f"seq_counts {bad} outside [1, max_running_requests={config.max_running_requests}]"
        )


def warmup(
    config: runner_config.RunnerConfig,
    engine: step_engine.StepEngine,
    run_logits: Callable[[planning.StepPlan], object],
    token_counts: Sequence[int],
    modes: Sequence[ForwardMode],
    seq_counts: Sequence[int],
    outputs: str,
) -> None:
    """Runs the synthetic step of every requested shape (see the module docstring).

    Args:
      config: the runner's config.
      engine: its step engine (token programs run there).
      run_logits: runs a logits plan as ``forward`` does (checks included).
      token_counts, modes, seq_counts, outputs: as ``ModelRunner.warmup``'s.

    Raises:
      ValueError: what ``check_arguments`` raises.
    """
    check_arguments(config, seq_counts, outputs)
    both = (False, True) if config.auto else (config.plan.enable_tbo,)
    for count in token_counts:
        for mode in map(ForwardMode, modes):
            seqs = [count] if mode.is_decode() else [s for s in seq_counts if s <= count]
            for num_seqs, tbo in itertools.product(seqs, both):
                for plan in warmup_plans(config, count, mode, num_seqs, tbo, outputs):
                    if outputs == "logits":
                        run_logits(plan)
                        continue
                    sampler = step_io.SamplerKey(config.max_running_requests)
                    jax.block_until_ready(engine.execute(plan, sampler, engine.prev_tokens(None)))


def warmup_plans(
    config: runner_config.RunnerConfig,
    count: int,
    mode: ForwardMode,
    num_seqs: int,
    tbo: bool,
    outputs: str,
) -> list[planning.StepPlan]:
    """Real plans for one synthetic batch on rank 0 that write only the padding slot: the
    plain plan, or the TBO plan at its child capacity and at each larger one (token plans:
    sampled from each sequence's last row, every id from the host)."""
    batch = synthetic_batch(mode, count, num_seqs)
    batches = [batch] + [planning.idle_batch()] * (config.dp_size - 1)
    padding = "max_len" if config.plan.dp_padding == "auto" else config.plan.dp_padding
    options = dataclasses.replace(config.plan, enable_tbo=tbo, dp_padding=padding)
    logits = "last" if outputs == "tokens" else "all"
    plans = _tbo_plans(batches, config.local_dp_ranks, options, logits)
    if outputs == "tokens":
        rows = config.max_running_requests
        plans = [
            token_step.add_token_inputs(plan, [None] * len(plan.ranks), None, rows, greedy=True)
            for plan in plans
        ]
    return plans


def _tbo_plans(batches, ranks, options, logits: str) -> list[planning.StepPlan]:
    """``warmup_plans``' plans before their token inputs."""
    plan = planning.plan_step_for_ranks(batches, ranks, options, logits=logits)
    if plan.child_capacity is None:
        return [plan]
    larger = [
        child
        for child in planning.child_capacities(plan.capacity, plan.mode, None, options)
        if child > plan.child_capacity
    ]
    return [plan] + [
        planning.plan_step_for_ranks(batches, ranks, options, logits=logits, child_capacity=child)
        for child in larger
    ]


def synthetic_batch(mode: ForwardMode, count: int, num_seqs: int) -> split.ForwardBatch:
    """``count`` tokens (decode: sequences; extend: ``num_seqs`` near-equal prompts) that
    read and write only the padding slot through request row 0."""
    ids = np.zeros(count, np.int32)  # token 0, position 0, KV slot 0 (the padding slot)
    ones = np.ones(count, np.int32)
    if mode.is_decode():
        return split.ForwardBatch(
            forward_mode=mode, batch_size=count, input_ids=ids, positions=ids,
            out_cache_loc=ids, req_pool_indices=ids, seq_lens=ones,
        )  # fmt: skip
    lens = np.full(num_seqs, count // num_seqs)
    lens[: count % num_seqs] += 1
    rows = np.zeros(num_seqs, np.int32)
    return split.ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=num_seqs, input_ids=ids, positions=ids,
        out_cache_loc=ids, req_pool_indices=rows, seq_lens=lens, extend_seq_lens=lens,
        extend_prefix_lens=rows,
    )  # fmt: skip
