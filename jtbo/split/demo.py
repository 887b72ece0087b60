"""Split-plan demo over random batches: ``python -m jtbo.split.demo``.

Each step builds one random batch per DP rank (fixed seed), plans the TBO split on the host
(``plan_tbo_split``), splits it (``split_batch``) and checks the plan against the static child
capacity of the rank's token bucket. It prints one row per rank: mode, sequences, tokens,
bucket, split sequence / token index, the children's parent token ranges, whether the split
is two-chunk, the children's padded lengths and whether the plan fits the child capacity.
DP agreement on the forward mode is not applied here (every rank's own plan is shown).
"""

import sys

import numpy as np

from jtbo.split import activations, batch, children, plan
from jtbo.split import buckets as buckets_lib
from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode
DP_SIZE = 4
ATTN_TP_SIZE = 2
MAX_TOKENS = 8192
DRAFT_TOKEN_NUM = 4
HEADER = (
    f"{'step':>4} {'rank':>4} {'mode':<13} {'seqs':>4} {'tokens':>6} {'bucket':>6} "
    f"{'s_seq':>5} {'s_tok':>5} {'A rows':>12} {'B rows':>12} {'2chunk':>6} "
    f"{'A pad':>5} {'B pad':>5} {'cap':>5} {'fits':>4}"
)


def _extend(
    rng: np.random.Generator, num_seqs: int, long_prompt: bool = False, lens=None
) -> batch.ForwardBatch:
    lens = rng.integers(1, 300, num_seqs) if lens is None else np.asarray(lens)
    if long_prompt:
        lens[0] = 3000
    prefix = rng.integers(0, 500, num_seqs)
    n = int(lens.sum())
    return batch.ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=num_seqs,
        input_ids=rng.integers(0, 32000, n),
        positions=np.concatenate([p + np.arange(k) for k, p in zip(lens, prefix, strict=True)]),
        seq_lens=prefix + lens,
        extend_seq_lens=lens,
        extend_prefix_lens=prefix,
    )


def _decode(rng: np.random.Generator, num_seqs: int) -> batch.ForwardBatch:
    seq_lens = rng.integers(1, 4000, num_seqs)
    return batch.ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=num_seqs,
        input_ids=rng.integers(0, 32000, num_seqs),
        positions=seq_lens - 1,
        seq_lens=seq_lens,
    )


def _verify(rng: np.random.Generator, num_seqs: int) -> batch.ForwardBatch:
    prefix = rng.integers(1, 200, num_seqs)
    n = num_seqs * DRAFT_TOKEN_NUM
    mask_len = int(((prefix + DRAFT_TOKEN_NUM) * DRAFT_TOKEN_NUM).sum())
    spec = batch.SpecVerifyInput(
        draft_token=rng.integers(0, 32000, n),
        custom_mask=rng.random(mask_len) < 0.5,
        seq_lens=prefix,
        draft_token_num=DRAFT_TOKEN_NUM,
    )
    return batch.ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=num_seqs,
        input_ids=spec.draft_token,
        seq_lens=prefix,  # committed lengths, without the draft tokens (SGLang)
        spec_info=spec,
    )


def _idle() -> batch.ForwardBatch:
    return batch.ForwardBatch(forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=np.zeros(0))


def _steps(rng: np.random.Generator):
    yield [_extend(rng, int(rng.integers(2, 12)), long_prompt=r == 1) for r in range(DP_SIZE)]
    yield [_decode(rng, int(rng.integers(1, 200))) for _ in range(DP_SIZE)]
    yield [_verify(rng, int(rng.integers(1, 64))) for _ in range(DP_SIZE - 1)] + [_idle()]
    # Small prefills: one prompt (two-chunk), two prompts, one 1-token prompt (SGLang's
    # degenerate fallback: no two-chunk, child A empty), and an idle rank.
    yield [_extend(rng, 1), _extend(rng, 2), _extend(rng, 1, lens=[1]), _idle()]


def _row(step: int, rank: int, parent: batch.ForwardBatch, buckets: tuple[int, ...]) -> str:
    planned = children.plan_tbo_split(parent)
    a, b = children.split_batch(planned, attn_tp_size=ATTN_TP_SIZE)
    two_chunk = a.batch_size + b.batch_size > parent.batch_size
    bucket = buckets_lib.token_bucket(parent.num_tokens, buckets)
    per_seq = plan.get_token_num_per_seq(parent.forward_mode, parent.spec_info) or 1
    cap = activations.child_capacity(bucket, attn_tp_size=ATTN_TP_SIZE, token_num_per_seq=per_seq)
    split_token = a.num_tokens
    fits = activations.plan_fits_capacity(split_token, parent.num_tokens, child_capacity=cap)
    a_rows, b_rows = (
        f"[{s}, {e})" for s, e in (a.tbo_parent_token_range, b.tbo_parent_token_range)
    )
    return (
        f"{step:>4} {rank:>4} {parent.forward_mode.name:<13} {parent.batch_size:>4} "
        f"{parent.num_tokens:>6} {bucket:>6} {planned.tbo_split_seq_index:>5} {split_token:>5} "
        f"{a_rows:>12} {b_rows:>12} {'yes' if two_chunk else 'no':>6} "
        f"{a.tbo_padded_len:>5} {b.tbo_padded_len:>5} {cap:>5} {'yes' if fits else 'NO':>4}"
    )


def main(argv: list[str]) -> None:
    """Prints the TBO split plan of a few random DP steps.

    Args:
      argv: ``[seed]`` (default 0).
    """
    seed = int(argv[0]) if argv else 0
    rng = np.random.default_rng(seed)
    buckets = buckets_lib.default_token_buckets(MAX_TOKENS)
    print(f"jtbo split plan: dp={DP_SIZE} attn_tp={ATTN_TP_SIZE} seed={seed} buckets={buckets}")
    print(HEADER)
    for step, parents in enumerate(_steps(rng)):
        for rank, parent in enumerate(parents):
            print(_row(step, rank, parent, buckets))


if __name__ == "__main__":
    main(sys.argv[1:])
