"""The step's TBO decision (``planning.decide``) against SGLang's ``TboDPAttentionPreparer`` cases.

TBO runs only when it is enabled, some rank is busy, every busy rank runs the same TBO-able
mode, and every busy rank found a split that fits the child capacity; idle ranks join with
split 0. (SGLang's DeepEP low-latency rule, no TBO for a real extend under low-latency
all-to-all kernels, has no counterpart: jtbo has no low-latency exchange.)
"""

import dataclasses

import pytest

from jtbo.runner import planning
from jtbo.split import ForwardMode as FM

OPTIONS = planning.PlanOptions(
    attn_tp_size=1, token_buckets=(16, 64), seq_capacity=8, max_context=256, enable_tbo=True,
    threshold=0.48,
)  # fmt: skip


def rank(mode, tokens, split=None):
    """A rank's summary; ``split`` defaults to half its tokens (None: no split found)."""
    split = tokens // 2 if split is None else split
    return planning.RankSummary(
        mode, tokens, None, 0 if split == -1 else 1, None if split == -1 else split
    )


IDLE = planning.RankSummary(FM.IDLE, 0, None, None, None)

# (ranks, enable_tbo, the agreed TBO mode or None)
CASES = {
    "all-decode": ([rank(FM.DECODE, 8), rank(FM.DECODE, 6)], True, FM.DECODE),
    "tbo-disabled": ([rank(FM.DECODE, 8), rank(FM.DECODE, 6)], False, None),
    "mixed-modes": ([rank(FM.EXTEND, 30), rank(FM.DECODE, 6)], True, None),
    "idle-rank-joins": ([rank(FM.EXTEND, 30), IDLE], True, FM.EXTEND),
    "all-idle": ([IDLE, IDLE], True, None),
    "one-rank-no-split": ([rank(FM.DECODE, 8), rank(FM.DECODE, 6, split=-1)], True, None),
    "split-too-uneven": ([rank(FM.EXTEND, 60, split=2), rank(FM.EXTEND, 30)], True, None),
    "verify": ([rank(FM.TARGET_VERIFY, 8), rank(FM.TARGET_VERIFY, 8)], True, FM.TARGET_VERIFY),
}


@pytest.mark.parametrize("name", CASES)
def test_sglang_agreement_cases(name):
    ranks, enable, want = CASES[name]
    options = dataclasses.replace(OPTIONS, enable_tbo=enable)
    decision = planning.decide(ranks, options)
    if want is None:
        assert decision.child_capacity is None and decision.split_token_index is None
        assert decision.mode == FM.EXTEND  # the plain step's strategy key
        return
    assert decision.mode == want
    assert decision.child_capacity is not None
    idle_splits = [
        s
        for r, s in zip(ranks, decision.split_token_index, strict=True)
        if r.forward_mode.is_idle()
    ]
    assert idle_splits == [0] * len(idle_splits)
    assert decision.num_tokens == tuple(r.num_tokens for r in ranks)
