"""Plan-integer exchange: tables of simulated processes round-trip, refusals raise everywhere."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.runner import planning, step_exchange

ForwardMode = planning.ForwardMode
OWNERS = (0, 0, 1, 1)  # two processes driving two DP ranks each
MODES = [ForwardMode.IDLE, ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]


def _optional(draw, top):
    return draw(st.none() | st.integers(0, top))


@st.composite
def summaries(draw):
    out = []
    for _ in OWNERS:
        mode = draw(st.sampled_from(MODES))
        tokens = draw(st.integers(0, 5000))
        out.append(
            planning.RankSummary(
                mode,
                tokens,
                _optional(draw, 16),
                _optional(draw, 300),
                _optional(draw, tokens),
                _optional(draw, 1024),
            )  # fmt: skip
        )
    return out


def _gather(reports):
    return np.stack([step_exchange.encode(r, len(OWNERS)) for r in reports])


def _reports(all_summaries, fingerprint=7, exchange=3, errors=(None, None)):
    return [
        step_exchange.LocalReport(
            exchange,
            fingerprint,
            {r: s for r, s in enumerate(all_summaries) if OWNERS[r] == p and errors[p] is None},
            errors[p],
        )  # fmt: skip
        for p in (0, 1)
    ]


@settings(max_examples=25, deadline=None)
@given(summaries())
def test_every_process_decodes_every_ranks_summary_from_its_owner(all_summaries):
    gathered = _gather(_reports(all_summaries))
    assert gathered.dtype == np.int32
    for _ in (0, 1):  # every process decodes the same table the same way
        assert step_exchange.decode_summaries(gathered, OWNERS) == all_summaries


def test_a_refusal_raises_its_own_error_there_and_names_it_everywhere_else():
    ok = [planning.RankSummary(ForwardMode.EXTEND, 4, None, 1, 2)] * 4
    error = ValueError("rank 2: token ids span [1, 500], vocabulary is [0, 128)")
    gathered = _gather(_reports(ok, errors=(None, error)))
    with pytest.raises(ValueError) as raised:
        step_exchange.decode_summaries(gathered, OWNERS, own_error=error)
    assert raised.value is error
    with pytest.raises(step_exchange.StepRejectedError, match=r"process 1: ValueError: rank 2"):
        step_exchange.decode_summaries(gathered, OWNERS)


def test_an_unexpected_error_elsewhere_is_a_runtime_error():
    ok = [planning.RankSummary(ForwardMode.IDLE, 0, None, None, None)] * 4
    gathered = _gather(_reports(ok, errors=(KeyError("boom"), None)))
    with pytest.raises(step_exchange.ProcessFailedError, match="process 0: KeyError: 'boom'"):
        step_exchange.decode_summaries(gathered, OWNERS)


@pytest.mark.parametrize("field", ["fingerprint", "exchange"])
def test_processes_out_of_step_or_set_up_differently_are_refused(field):
    ok = [planning.RankSummary(ForwardMode.DECODE, 2, None, 1, 1)] * 4
    a, b = _reports(ok)
    b = step_exchange.LocalReport(**{**b.__dict__, field: getattr(b, field) + 1})
    with pytest.raises(
        step_exchange.StepRejectedError, match=rf"disagree on {field}: \[\d+, \d+\]"
    ):
        step_exchange.decode_summaries(_gather([a, b]), OWNERS)


def test_long_non_ascii_messages_are_cut_not_broken():
    ok = [planning.RankSummary(ForwardMode.IDLE, 0, None, None, None)] * 4
    error = ValueError("é" * 1000)
    gathered = _gather(_reports(ok, errors=(None, error)))
    assert gathered.shape[1] == 4 + 4 * 6 + step_exchange.MESSAGE_BYTES
    with pytest.raises(step_exchange.StepRejectedError, match="ValueError: éé"):
        step_exchange.decode_summaries(gathered, OWNERS)


def test_single_process_exchange_returns_its_summaries():
    ok = [planning.RankSummary(ForwardMode.EXTEND, 9, None, 1, 4)] * 2
    report = step_exchange.LocalReport(0, 1, dict(enumerate(ok)))
    assert step_exchange.exchange(report, (0, 0)) == ok


def test_fingerprint_is_stable_and_sensitive():
    def plan_options(buckets):
        return planning.PlanOptions(
            attn_tp_size=2, token_buckets=buckets, seq_capacity=4, max_context=64,
            enable_tbo=True, threshold=0.48,
        )  # fmt: skip

    options, same, other = plan_options((8, 16)), plan_options((8, 16)), plan_options((8, 32))
    assert step_exchange.fingerprint(options, (4, 2)) == step_exchange.fingerprint(same, (4, 2))
    assert step_exchange.fingerprint(options, (4, 2)) != step_exchange.fingerprint(other, (4, 2))
    assert 0 <= step_exchange.fingerprint(options) < 2**31
