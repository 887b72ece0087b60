"""Deduplicated EP dispatch/combine against a numpy model and against ``ep_dispatch``."""

import dataclasses
import functools
import itertools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jtbo.collectives import ep_config, ep_dedup, ep_dispatch, ep_overflow
from jtbo.collectives import mesh as mesh_lib
from jtbo.kernels import slot_rows
from tests.collectives import harness

NUM_DEVICES = 8
TOKENS = 6
NUM_EXPERTS = 16  # two per device
HIDDEN = 4


def _moe_step(dispatcher, hidden, ids, weights, num_valid, outputs_as_rows=False):
    module = ep_dedup if dispatcher.dedup else ep_dispatch
    in_flight = module.dispatch_a(dispatcher, hidden, ids, weights, num_valid[0])
    slots, state = module.dispatch_b(dispatcher, in_flight)
    expert_inputs = slots.materialize()
    # Expert e multiplies by e + 1, so a row sent astray or summed twice shows.
    me = jax.lax.axis_index(mesh_lib.TP_AXES)
    global_ids = me * dispatcher.num_local_experts + jnp.arange(dispatcher.num_local_experts)
    outputs = expert_inputs * (global_ids + 1).astype(expert_inputs.dtype)[:, None, None]
    if outputs_as_rows:  # the outputs as rows in reverse slot order and a row per slot
        flat = outputs.reshape(-1, outputs.shape[-1])
        reverse = jnp.arange(flat.shape[0] - 1, -1, -1, dtype=jnp.int32)
        outputs = slot_rows.SlotRows(flat[reverse], reverse.reshape(outputs.shape[:2]))
    combined = module.combine_b(dispatcher, module.combine_a(dispatcher, outputs, state))
    return combined, state.overflow, state.peak_load


@functools.cache
def runner(dispatcher, dp_size, outputs_as_rows=False):
    shard = P(mesh_lib.TP_AXES)
    return jax.jit(
        jax.shard_map(
            functools.partial(_moe_step, dispatcher, outputs_as_rows=outputs_as_rows),
            mesh=harness.mesh(dp_size, NUM_DEVICES // dp_size),
            in_specs=(shard,) * 4,  # hidden, topk ids, weights, valid counts
            out_specs=(shard,) * 3,  # combined, overflow [2], peak_load [2] per device
            check_vma=False,
        )
    )


def run(dispatcher, dp_size, hidden, ids, weights, num_valid, outputs_as_rows=False):
    top_k = ids.shape[-1]
    out = runner(dispatcher, dp_size, outputs_as_rows)(
        hidden.reshape(-1, HIDDEN), ids.reshape(-1, top_k), weights.reshape(-1, top_k), num_valid
    )
    return [harness.per_device(x, NUM_DEVICES) for x in out]


def reference(hidden, ids, weights, num_valid, peer_capacity, expert_capacity):
    """Numpy model: (token, device) rows first come first served per device in token order,
    then assignments per local expert in (source, slot, top-k) order.

    Returns: ``(out [devices, tokens, H], overflow [devices, 2], peak [devices, 2])``.
    """
    local = NUM_EXPERTS // NUM_DEVICES
    sent = [[[] for _ in range(NUM_DEVICES)] for _ in range(NUM_DEVICES)]
    overflow = np.zeros((NUM_DEVICES, 2), np.int64)
    peak = np.zeros((NUM_DEVICES, 2), np.int64)
    for d in range(NUM_DEVICES):
        hits = np.zeros(NUM_DEVICES, np.int64)
        for t in range(num_valid[d]):
            routed = [e for e in ids[d, t] if 0 <= e < NUM_EXPERTS]
            for p in sorted({e // local for e in routed}):
                hits[p] += 1
                if len(sent[d][p]) < peer_capacity:
                    sent[d][p].append(t)
                else:
                    overflow[d, 0] += 1
        peak[d, 0] = hits.max()
    out = np.zeros((NUM_DEVICES, TOKENS, HIDDEN))
    for p in range(NUM_DEVICES):
        given = np.zeros(local, np.int64)
        for d in range(NUM_DEVICES):
            for t in sent[d][p]:
                for j, e in enumerate(ids[d, t]):
                    if not (0 <= e < NUM_EXPERTS and e // local == p):
                        continue
                    given[e % local] += 1
                    if given[e % local] <= expert_capacity:
                        out[d, t] += weights[d, t, j] * (e + 1) * hidden[d, t]
                    else:
                        overflow[p, 1] += 1
        peak[p, 1] = given.max()
    return out, overflow, peak


def routing(rng, top_k, case):
    hidden = rng.standard_normal((NUM_DEVICES, TOKENS, HIDDEN)).astype(np.float32)
    ids = np.stack(
        [
            np.stack([rng.choice(NUM_EXPERTS, top_k, replace=False) for _ in range(TOKENS)])
            for _ in range(NUM_DEVICES)
        ]
    ).astype(np.int32)
    if case == "skewed":  # everyone prefers device 0's experts; most devices get nothing
        ids[:, :, 0], ids[:, :, 1] = 0, 1
        ids[:, :, 2:] = np.where(ids[:, :, 2:] < 2, ids[:, :, 2:] + 2, ids[:, :, 2:])  # distinct
    elif case == "one-expert":  # every token on expert 5 only
        ids[:, :, 0] = 5
        ids[:, :, 1:] = -1
    ids[1, 0, -1] = -1  # an unrouted choice is skipped
    weights = rng.uniform(0.1, 1.0, (NUM_DEVICES, TOKENS, top_k)).astype(np.float32)
    num_valid = rng.integers(0, TOKENS + 1, NUM_DEVICES).astype(np.int32)
    num_valid[0], num_valid[-1] = TOKENS, 0  # a full device and an idle one (padding rows)
    return hidden, ids, weights, num_valid


def dispatchers(dp_size, top_k, **kwargs):
    mesh = harness.mesh(dp_size, NUM_DEVICES // dp_size)
    make = functools.partial(
        ep_config.create_ep_dispatcher, mesh, num_experts=NUM_EXPERTS, num_tokens=TOKENS,
        top_k=top_k, slot_alignment=1, **kwargs,
    )  # fmt: skip
    return make(), make(dedup=True)


@pytest.mark.parametrize(
    "case, top_k, dp_size",
    [("random", 3, 4), ("skewed", 2, 2), ("one-expert", 3, 8)],
)
def test_dedup_equals_per_assignment_exchange_and_reference(case, top_k, dp_size):
    rng = np.random.default_rng(len(case) + top_k)
    hidden, ids, weights, num_valid = routing(rng, top_k, case)
    old, dedup = dispatchers(dp_size, top_k, worst_case=True)
    assert dedup.local_ids_per_row == min(top_k, 2)  # top_k 3 packs 2 ids per row
    got, overflow, _ = run(dedup, dp_size, hidden, ids, weights, num_valid)
    want, _, _ = run(old, dp_size, hidden, ids, weights, num_valid)
    ref, _, _ = reference(hidden, ids, weights, num_valid, TOKENS, TOKENS * NUM_DEVICES)
    assert overflow.sum() == 0
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)


def test_both_combines_read_expert_outputs_given_as_slot_rows():
    rng = np.random.default_rng(11)
    hidden, ids, weights, num_valid = routing(rng, 3, "random")
    ref, _, _ = reference(hidden, ids, weights, num_valid, TOKENS, TOKENS * NUM_DEVICES)
    for dispatcher in dispatchers(4, 3, worst_case=True):
        got, _, _ = run(dispatcher, 4, hidden, ids, weights, num_valid, outputs_as_rows=True)
        chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("via_host", ["0", "1"], ids=["direct", "via_host"])
def test_dedup_over_the_peer_copy_equals_the_reference(via_host, monkeypatch):
    # The copy-engine exchange (CPU twin here), straight or staged through host memory as
    # `bench tbo --link host` runs it.
    monkeypatch.setenv("JTBO_PEER_COPY_VIA_HOST", via_host)
    hidden, ids, weights, num_valid = routing(np.random.default_rng(11), 3, "random")
    _, dedup = dispatchers(4, 3, worst_case=True, exchange="peer_copy")
    got, overflow, _ = run(dedup, 4, hidden, ids, weights, num_valid)
    ref, _, _ = reference(hidden, ids, weights, num_valid, TOKENS, TOKENS * NUM_DEVICES)
    assert overflow.sum() == 0
    chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case, peer_capacity, expert_capacity", [("skewed", 3, 5), ("random", 1, 1)]
)
def test_overflow_and_peak_match_reference(case, peer_capacity, expert_capacity):
    rng = np.random.default_rng(peer_capacity)
    hidden, ids, weights, num_valid = routing(rng, 3, case)
    _, dedup = dispatchers(4, 3)
    dedup = dataclasses.replace(dedup, peer_capacity=peer_capacity, expert_capacity=expert_capacity)
    got, overflow, peak = run(dedup, 4, hidden, ids, weights, num_valid)
    want, want_overflow, want_peak = reference(
        hidden, ids, weights, num_valid, peer_capacity, expert_capacity
    )
    assert want_overflow[:, 0].sum() > 0 and want_overflow[:, 1].sum() > 0  # both overflow
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(overflow.reshape(NUM_DEVICES, 2), want_overflow)
    np.testing.assert_array_equal(peak.reshape(NUM_DEVICES, 2), want_peak)


def test_rerun_on_overflow_reaches_the_exact_result():
    rng = np.random.default_rng(21)
    hidden, ids, weights, num_valid = routing(rng, 2, "skewed")
    _, dedup = dispatchers(8, 2, capacity_factor=0.5)
    want, _, _ = reference(hidden, ids, weights, num_valid, TOKENS, TOKENS * NUM_DEVICES)
    for _ in range(4):
        got, overflow, peak = run(dedup, 8, hidden, ids, weights, num_valid)
        bigger = ep_overflow.resolve_overflow(dedup, overflow, peak_load=peak, slot_alignment=1)
        if bigger is None:
            break
        assert bigger.peer_capacity <= bigger.worst_peer_capacity == TOKENS
        dedup = bigger
    assert bigger is None
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_rows_carry_ids_and_weights_bit_exact():
    # Ids (-1 is a NaN pattern in bf16) and float32 weights ride in bf16 column pairs.
    rng = np.random.default_rng(5)
    hidden, ids, weights, num_valid = routing(rng, 3, "random")
    _, dedup = dispatchers(8, 3, worst_case=True)
    narrow = hidden.astype(jnp.bfloat16)
    got, _, _ = run(dedup, 8, narrow, ids, weights, num_valid)
    want, _, _ = reference(
        np.asarray(narrow, np.float32), ids, weights, num_valid, TOKENS, TOKENS * NUM_DEVICES
    )
    chex.assert_trees_all_close(np.asarray(got, np.float32), want, rtol=2e-2, atol=5e-2)


def test_expected_ranks_per_token_and_capacity_rule():
    # Brute force over every top-k set of experts.
    for experts, devices, top_k in ((8, 4, 1), (8, 4, 2), (8, 4, 3), (16, 8, 3), (12, 3, 5)):
        sets = itertools.combinations(range(experts), top_k)
        mean = np.mean([len({e // (experts // devices) for e in s}) for s in sets])
        assert math.isclose(ep_config.expected_ranks_per_token(experts, devices, top_k), mean)
    mesh = harness.mesh(4, 2)
    dedup = ep_config.create_ep_dispatcher(
        mesh, num_experts=64, num_tokens=128, top_k=8, capacity_factor=1.2, dedup=True
    )
    expected = 128 * ep_config.expected_ranks_per_token(64, 8, 8) / 8
    assert dedup.peer_capacity == ep_config.round_up(math.ceil(1.2 * expected), 8) == 112
    assert dedup.worst_peer_capacity == 128
    with pytest.raises(ValueError, match="top_k=9"):
        ep_config.expected_ranks_per_token(8, 4, 9)
    with pytest.raises(ValueError, match="dedup=True"):
        ep_dedup.dispatch_a(
            dataclasses.replace(dedup, dedup=False), jnp.zeros((128, 4)),
            jnp.zeros((128, 8), jnp.int32), jnp.zeros((128, 8)), 128,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="ragged_all_to_all needs a GPU")
def test_dedup_dense_ragged_and_peer_copy_agree_on_gpu():
    num_devices = len(jax.devices())
    mesh = mesh_lib.make_mesh(num_devices, 1)
    rng = np.random.default_rng(4)
    tokens, top_k, num_experts = 32, 3, 4 * num_devices
    hidden = rng.standard_normal((num_devices * tokens, HIDDEN)).astype(np.float32)
    ids = np.stack(
        [rng.choice(num_experts, top_k, replace=False) for _ in range(num_devices * tokens)]
    ).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (num_devices * tokens, top_k)).astype(np.float32)
    num_valid = rng.integers(0, tokens + 1, num_devices).astype(np.int32)
    results = {}
    for exchange, dedup in (
        ("dense", False), ("dense", True), ("ragged", True), ("peer_copy", True)
    ):  # fmt: skip
        dispatcher = ep_config.create_ep_dispatcher(
            mesh, num_experts=num_experts, num_tokens=tokens, top_k=top_k, exchange=exchange,
            dedup=dedup, worst_case=True,
        )  # fmt: skip
        step = jax.jit(
            jax.shard_map(
                functools.partial(_moe_step, dispatcher),
                mesh=mesh,
                in_specs=(P(mesh_lib.TP_AXES),) * 4,  # hidden, topk ids, weights, valid counts
                out_specs=(P(mesh_lib.TP_AXES),) * 3,
                check_vma=False,
            )
        )
        results[exchange, dedup] = np.asarray(step(hidden, ids, weights, num_valid)[0])
    for got in (results["dense", True], results["ragged", True], results["peer_copy", True]):
        np.testing.assert_allclose(got, results["dense", False], rtol=1e-4, atol=1e-4)
