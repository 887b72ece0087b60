"""Planning a process's own ranks: the same decision and rows as planning all ranks at once."""

import chex
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.runner import planning, step_exchange
from tests.runner import helpers

DP = 4
OPTIONS = planning.PlanOptions(
    attn_tp_size=2, token_buckets=(8, 16, 32), seq_capacity=4, max_context=64,
    enable_tbo=True, threshold=0.48,
)  # fmt: skip
work = st.one_of(
    st.none(),
    st.just("decode"),
    st.lists(st.integers(1, 9), min_size=1, max_size=3).filter(lambda lens: sum(lens) <= 32),
)


def _batches(script, seed):
    rng = np.random.default_rng(seed)
    out = []
    for item in script:
        rank = helpers.Rank()
        if item is None:
            out.append(planning.idle_batch())
            continue
        lens = [3, 5] if item == "decode" else item
        batch = rank.extend({r: rng.integers(0, 128, n).tolist() for r, n in enumerate(lens)})
        if item == "decode":
            batch = rank.decode({r: int(rng.integers(128)) for r in range(len(lens))})
        out.append(batch)
    return out


@settings(max_examples=20, deadline=None)
@given(st.lists(work, min_size=DP, max_size=DP), st.integers(0, 99), st.sets(st.integers(0, 3)))
def test_a_process_plans_its_own_rows_of_the_all_ranks_plan(script, seed, mine):
    batches = _batches(script, seed)
    whole = planning.plan_step(batches, OPTIONS)
    ranks = tuple(sorted(mine)) or (0,)
    local = [planning.summarize(batches[r], OPTIONS) for r in ranks]
    # Summaries as the other processes send them: through the exchange table.
    report = step_exchange.LocalReport(
        0, 0, {r: planning.summarize(b, OPTIONS).summary for r, b in enumerate(batches)}
    )
    table = step_exchange.encode(report, DP)[None]
    decision = planning.decide(step_exchange.decode_summaries(table, (0,) * DP), OPTIONS)
    part = planning.assemble(local, ranks, decision, OPTIONS)
    assert (part.capacity, part.child_capacity, part.mode, part.num_tokens) == (
        whole.capacity, whole.child_capacity, whole.mode, whole.num_tokens,
    )  # fmt: skip
    assert part.ranks == ranks and whole.ranks == tuple(range(DP))
    chex.assert_trees_all_equal(part.replicated, whole.replicated)
    own_rows = jax.tree.map(lambda x: np.asarray(x)[list(ranks)], whole.per_rank)
    chex.assert_trees_all_equal(part.per_rank, own_rows)


def test_decision_uses_only_the_summaries():
    batches = _batches([[5, 3, 4], [14], None, "decode"], 0)
    summaries = [planning.summarize(b, OPTIONS).summary for b in batches]
    decision = planning.decide(summaries, OPTIONS)
    assert decision == planning.decide(list(summaries), OPTIONS)
    assert decision.kind == "extend" and decision.child_capacity is None  # modes disagree
    same_mode = summaries[:3] + [summaries[2]]  # rank 3 idle instead of decoding
    tbo = planning.decide(same_mode, OPTIONS)
    assert tbo.mode == planning.ForwardMode.EXTEND and tbo.child_capacity is not None
    assert tbo.split_token_index[2] == 0  # idle ranks split at 0


def test_all_idle_and_too_large_steps():
    idle = planning.summarize(planning.idle_batch(), OPTIONS).summary
    assert planning.decide([idle] * DP, OPTIONS).all_idle
    big = planning.RankSummary(planning.ForwardMode.EXTEND, 40, None, None, None)
    with pytest.raises(ValueError, match="num_tokens=40 exceeds the largest bucket 32"):
        planning.decide([big] + [idle] * (DP - 1), OPTIONS)


def test_assemble_needs_children_for_a_tbo_step():
    batches = _batches([[5, 3], [4, 4], None, None], 1)
    decision = planning.decide([planning.summarize(b, OPTIONS).summary for b in batches], OPTIONS)
    no_children = planning.LocalRank(batches[0], planning.summarize(batches[0], OPTIONS).summary,
                                     None)  # fmt: skip
    with pytest.raises(ValueError, match="rank 0: a TBO step needs the rank's split children"):
        planning.assemble([no_children], (0,), decision, OPTIONS)


def test_decode_steps_plan_children_of_half_the_sequences(monkeypatch):
    # Every rank decodes or idles: the planner asks for the decode-only child bound.
    asked = []
    child_capacities = planning.split.child_capacities

    def spy(*args, **kwargs):
        asked.append(kwargs["decode_like"])
        return child_capacities(*args, **kwargs)

    monkeypatch.setattr(planning.split, "child_capacities", spy)
    plan = planning.plan_step(_batches(["decode", None, "decode", "decode"], 1), OPTIONS)
    assert plan.mode == planning.ForwardMode.DECODE and plan.child_capacity == 4
    assert plan.per_rank.attn_metadata is None  # a TBO step reads only the children's
    planning.plan_step(_batches([[3, 5], None, [4, 4], [8]], 1), OPTIONS)
    assert asked == [True, False]
