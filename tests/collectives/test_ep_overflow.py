"""The host's overflow policy: re-run with the next capacity bucket, or raise."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.collectives import ep_config, ep_overflow

BASE = ep_config.EpDispatcher(
    num_experts=16, ep_size=8, num_tokens=64, top_k=2, peer_capacity=16, expert_capacity=40
)


def test_no_overflow_keeps_the_result():
    assert ep_overflow.resolve_overflow(BASE, np.zeros((3, 8, 2)), policy="raise") is None
    assert ep_overflow.resolve_overflow(BASE, [0, 0]) is None


def test_rerun_raises_only_the_overflowed_capacity():
    per_device = np.zeros((8, 2), np.int32)
    per_device[3, 0] = 5  # peer overflow on one device
    rerun = ep_overflow.resolve_overflow(BASE, per_device, policy="rerun")
    assert (rerun.peer_capacity, rerun.expert_capacity) == (32, 40)
    per_device[3] = (0, 2)
    rerun = ep_overflow.resolve_overflow(BASE, per_device, policy="rerun")
    assert (rerun.peer_capacity, rerun.expert_capacity) == (16, 80)


def test_rerun_buckets_stop_at_the_worst_case():
    dispatcher = BASE
    for _ in range(10):
        if dispatcher.peer_capacity == dispatcher.worst_peer_capacity:
            break
        dispatcher = ep_overflow.resolve_overflow(dispatcher, [1, 0])
    assert dispatcher.peer_capacity == dispatcher.worst_peer_capacity == 128
    with pytest.raises(ep_overflow.CapacityOverflowError, match="already the worst case 128"):
        ep_overflow.resolve_overflow(dispatcher, [1, 0])


def test_rerun_sizes_the_capacity_on_the_reported_peak():
    per_device = np.zeros((8, 2), np.int32)
    per_device[2] = (0, 3)  # expert overflow
    peaks = np.zeros((8, 2), np.int32)
    peaks[:, 1] = 41
    peaks[5, 1] = 61  # the max over devices counts
    rerun = ep_overflow.resolve_overflow(BASE, per_device, peak_load=peaks)
    assert (rerun.peer_capacity, rerun.expert_capacity) == (16, 64)  # 61 rounded to 8
    peaks[5, 1] = 43  # just over the capacity: at least MIN_GROWTH * 40 = 50 -> 56
    rerun = ep_overflow.resolve_overflow(BASE, per_device, peak_load=peaks)
    assert rerun.expert_capacity == 56
    with pytest.raises(ValueError, match="peak_load shape"):
        ep_overflow.resolve_overflow(BASE, per_device, peak_load=[1, 2, 3])


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 500),
    extra=st.integers(1, 2000),
    worst=st.integers(1, 3000),
    alignment=st.sampled_from([1, 8, 16]),
)
def test_peak_bucket_covers_the_peak_and_grows(capacity, extra, worst, alignment):
    peak = capacity + extra  # an overflow means the peak exceeded the capacity
    bucket = ep_overflow.next_capacity_bucket(capacity, worst, alignment, peak)
    assert bucket <= worst
    if bucket < worst:
        assert bucket >= peak and bucket >= ep_overflow.MIN_GROWTH * capacity
        assert bucket % alignment == 0
        assert bucket - max(peak, ep_overflow.MIN_GROWTH * capacity) < alignment


def test_raise_names_the_capacity():
    with pytest.raises(ep_overflow.CapacityOverflowError) as error:
        ep_overflow.resolve_overflow(BASE, [[4, 0], [3, 7]], policy="raise")
    message = str(error.value)
    assert "7 assignments overflowed peer_capacity=16" in message
    assert "next bucket 32" in message
    assert "7 assignments overflowed expert_capacity=40" in message
    dedup = dataclasses.replace(BASE, dedup=True)  # peer rows are (token, device) pairs
    with pytest.raises(ep_overflow.CapacityOverflowError, match=r"3 \(token, device\) rows"):
        ep_overflow.resolve_overflow(dedup, [3, 0], policy="raise")


def test_dedup_buckets_stop_at_one_row_per_token():
    dispatcher = dataclasses.replace(BASE, dedup=True)
    while dispatcher.peer_capacity < dispatcher.worst_peer_capacity:
        dispatcher = ep_overflow.resolve_overflow(dispatcher, [1, 0])
    assert dispatcher.peer_capacity == 64  # num_tokens, not num_tokens * top_k
    with pytest.raises(ep_overflow.CapacityOverflowError, match="already the worst case 64"):
        ep_overflow.resolve_overflow(dispatcher, [1, 0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy="):
        ep_overflow.resolve_overflow(BASE, [1, 0], policy="ignore")
    with pytest.raises(ValueError, match="must end in 2"):
        ep_overflow.total_overflow([1, 2, 3])


def test_rerun_loop_on_a_real_step_ends_exact():
    """Skewed routing overflows tiny capacities; re-running with the buckets converges to the
    reference result with no overflow."""
    from tests.collectives import test_ep_dispatch as ep

    rng = np.random.default_rng(1)
    hidden, ids, weights, num_valid = ep.routing(rng, skew=True)
    start = ep_config.create_ep_dispatcher(
        ep.harness.mesh(8, 1), num_experts=ep.NUM_EXPERTS, num_tokens=ep.TOKENS, top_k=ep.TOP_K
    )
    dispatcher = ep_config.EpDispatcher(**{**start.__dict__, "peer_capacity": 2})
    runs = 0
    while dispatcher is not None:
        out, overflow, _ = ep.run(dispatcher, 8, True, hidden, ids, weights, num_valid)
        last, dispatcher = dispatcher, ep_overflow.resolve_overflow(dispatcher, overflow)
        runs += 1
    assert runs > 1
    want, _ = ep.reference(
        hidden, ids, weights, num_valid, last.peer_capacity, last.expert_capacity, scale=True
    )
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
