"""EP dispatch/combine against a numpy model of routing, capacities and overflow."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jtbo.collectives import ep_config, ep_dispatch
from jtbo.collectives import mesh as mesh_lib
from tests.collectives import harness

NUM_DEVICES = 8
TOKENS = 6
TOP_K = 2
NUM_EXPERTS = 16
HIDDEN = 4


def _moe_step(dispatcher, scale_by_expert, hidden, ids, weights, num_valid):
    in_flight = ep_dispatch.dispatch_a(dispatcher, hidden, ids, weights, num_valid[0])
    slots, state = ep_dispatch.dispatch_b(dispatcher, in_flight)
    expert_inputs = slots.materialize()
    outputs = expert_inputs
    if scale_by_expert:  # expert e multiplies by e + 1, so a row sent astray shows
        me = jax.lax.axis_index(mesh_lib.TP_AXES)
        global_ids = me * dispatcher.num_local_experts + jnp.arange(dispatcher.num_local_experts)
        outputs = expert_inputs * (global_ids + 1).astype(expert_inputs.dtype)[:, None, None]
    combined = ep_dispatch.combine_b(dispatcher, ep_dispatch.combine_a(dispatcher, outputs, state))
    return combined, state.overflow, expert_inputs.reshape(-1, expert_inputs.shape[-1])


@functools.cache
def runner(dispatcher, dp_size, scale_by_expert):
    shard = P(mesh_lib.TP_AXES)
    return jax.jit(
        jax.shard_map(
            functools.partial(_moe_step, dispatcher, scale_by_expert),
            mesh=harness.mesh(dp_size, NUM_DEVICES // dp_size),
            in_specs=(shard, shard, shard, shard),  # hidden, topk ids, weights, valid counts
            out_specs=(shard, shard, shard),
            check_vma=False,
        )
    )


def reference(hidden, ids, weights, num_valid, peer_capacity, expert_capacity, scale):
    """Numpy model: first-come slots per peer (token order), then per expert (source order)."""
    local = NUM_EXPERTS // NUM_DEVICES
    sent = [[[] for _ in range(NUM_DEVICES)] for _ in range(NUM_DEVICES)]
    overflow = np.zeros((NUM_DEVICES, 2), np.int64)
    for d in range(NUM_DEVICES):
        for t in range(num_valid[d]):
            for j in range(TOP_K):
                e = ids[d, t, j]
                if not 0 <= e < NUM_EXPERTS:
                    continue
                peer = sent[d][e // local]
                if len(peer) < peer_capacity:
                    peer.append((t, j))
                else:
                    overflow[d, 0] += 1
    out = np.zeros((NUM_DEVICES, TOKENS, HIDDEN))
    for p in range(NUM_DEVICES):
        filled = np.zeros(local, np.int64)
        for d in range(NUM_DEVICES):
            for t, j in sent[d][p]:
                e = ids[d, t, j]
                if filled[e % local] < expert_capacity:
                    filled[e % local] += 1
                    factor = (e + 1) if scale else 1.0
                    out[d, t] += weights[d, t, j] * factor * hidden[d, t]
                else:
                    overflow[p, 1] += 1
    return out, overflow


def routing(rng, skew=False):
    hidden = rng.standard_normal((NUM_DEVICES, TOKENS, HIDDEN)).astype(np.float32)
    ids = np.stack(
        [
            np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(TOKENS)])
            for _ in range(NUM_DEVICES)
        ]
    ).astype(np.int32)
    if skew:  # everyone prefers the experts of device 0
        ids[:, :, 0] = 0
        ids[:, :, 1] = 1
    ids[1, 0, 1] = -1  # an unrouted slot is skipped
    weights = rng.uniform(0.1, 1.0, (NUM_DEVICES, TOKENS, TOP_K)).astype(np.float32)
    num_valid = rng.integers(0, TOKENS + 1, NUM_DEVICES).astype(np.int32)
    num_valid[0], num_valid[-1] = TOKENS, 0  # a full device and an idle one
    return hidden, ids, weights, num_valid


def run(dispatcher, dp_size, scale, hidden, ids, weights, num_valid):
    out, overflow, expert_inputs = runner(dispatcher, dp_size, scale)(
        hidden.reshape(-1, HIDDEN), ids.reshape(-1, TOP_K), weights.reshape(-1, TOP_K), num_valid
    )
    return (
        harness.per_device(out, NUM_DEVICES),
        harness.per_device(overflow, NUM_DEVICES),
        harness.per_device(expert_inputs, NUM_DEVICES),
    )


@pytest.mark.parametrize("dp_size", [8, 2])
def test_identity_experts_return_weighted_input(dp_size):
    rng = np.random.default_rng(dp_size)
    hidden, ids, weights, num_valid = routing(rng)
    dispatcher = ep_config.create_ep_dispatcher(
        harness.mesh(dp_size, NUM_DEVICES // dp_size),
        num_experts=NUM_EXPERTS,
        num_tokens=TOKENS,
        top_k=TOP_K,
        worst_case=True,
    )
    out, overflow, _ = run(dispatcher, dp_size, False, hidden, ids, weights, num_valid)
    routed = (ids >= 0) & (np.arange(TOKENS)[None, :, None] < num_valid[:, None, None])
    want = (weights * routed).sum(-1, keepdims=True) * hidden
    chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-6)
    assert overflow.sum() == 0


@pytest.mark.parametrize("exchange", ["dense", "peer_copy"])
@pytest.mark.parametrize(
    "skew, peer_capacity, expert_capacity",
    [(False, None, None), (True, 3, 5), (False, 1, 2)],
    ids=["default-capacity", "skewed-overflow", "tiny-capacity"],
)
def test_matches_reference_with_overflow(skew, peer_capacity, expert_capacity, exchange):
    rng = np.random.default_rng(3)
    hidden, ids, weights, num_valid = routing(rng, skew=skew)
    dispatcher = ep_config.create_ep_dispatcher(
        harness.mesh(4, 2),
        num_experts=NUM_EXPERTS,
        num_tokens=TOKENS,
        top_k=TOP_K,
        exchange=exchange,
    )
    if peer_capacity is not None:
        dispatcher = ep_config.EpDispatcher(
            **{
                **dispatcher.__dict__,
                "peer_capacity": peer_capacity,
                "expert_capacity": expert_capacity,
            }
        )
    out, overflow, _ = run(dispatcher, 4, True, hidden, ids, weights, num_valid)
    want, want_overflow = reference(
        hidden,
        ids,
        weights,
        num_valid,
        dispatcher.peer_capacity,
        dispatcher.expert_capacity,
        scale=True,
    )
    chex.assert_trees_all_close(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(overflow.reshape(NUM_DEVICES, 2), want_overflow)
    if peer_capacity is not None:
        assert want_overflow.sum() > 0  # the case exercises overflow


def test_expert_inputs_are_capacity_slots_and_no_retrace():
    rng = np.random.default_rng(9)
    dispatcher = ep_config.create_ep_dispatcher(
        harness.mesh(8, 1), num_experts=NUM_EXPERTS, num_tokens=TOKENS, top_k=TOP_K
    )
    step = chex.assert_max_traces(n=1)(_moe_step)
    shard = P(mesh_lib.TP_AXES)
    jitted = jax.jit(
        jax.shard_map(
            functools.partial(step, dispatcher, False),
            mesh=harness.mesh(8, 1),
            in_specs=(shard,) * 4,  # hidden, topk ids, weights, valid counts
            out_specs=(shard,) * 3,
            check_vma=False,
        )
    )
    for _ in range(2):  # new routing and new counts: same compiled step
        hidden, ids, weights, num_valid = routing(rng)
        flat = (hidden.reshape(-1, HIDDEN), ids.reshape(-1, TOP_K), weights.reshape(-1, TOP_K))
        _, overflow, expert_inputs = jitted(*flat, num_valid)
    assert np.asarray(overflow).sum() == 0
    local = dispatcher.num_local_experts
    slots = harness.per_device(expert_inputs, NUM_DEVICES).reshape(
        NUM_DEVICES, local, dispatcher.expert_capacity, HIDDEN
    )
    for expert in range(NUM_EXPERTS):
        got = slots[expert // local, expert % local]
        got = sorted(tuple(r) for r in got if r.any())
        want = sorted(
            tuple(hidden[d, t])
            for d in range(NUM_DEVICES)
            for t in range(num_valid[d])
            if expert in ids[d, t]
        )
        assert got == want, expert


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_rows_carry_their_expert_ids_bit_exact(dtype):
    # The dense exchange bitcasts the int32 expert ids into extra row columns: every id,
    # -1 (a NaN bit pattern in 16-bit floats) included, must come back exact.
    rng = np.random.default_rng(11)
    hidden, ids, weights, num_valid = routing(rng)
    dispatcher = ep_config.create_ep_dispatcher(
        harness.mesh(4, 2), num_experts=NUM_EXPERTS, num_tokens=TOKENS, top_k=TOP_K
    )
    narrow = hidden.astype(dtype)
    out, overflow, _ = run(dispatcher, 4, True, narrow, ids, weights, num_valid)
    want, want_overflow = reference(
        np.asarray(narrow, np.float32), ids, weights, num_valid,
        dispatcher.peer_capacity, dispatcher.expert_capacity, scale=True,
    )  # fmt: skip
    chex.assert_trees_all_close(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(overflow.reshape(NUM_DEVICES, 2), want_overflow)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU's refusal")
def test_ragged_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="ragged.*GPU"):
        ep_config.create_ep_dispatcher(
            harness.mesh(8, 1),
            num_experts=NUM_EXPERTS,
            num_tokens=TOKENS,
            top_k=TOP_K,
            exchange="ragged",
        )


def test_capacity_rule():
    mesh = harness.mesh(4, 2)
    default = ep_config.create_ep_dispatcher(
        mesh, num_experts=64, num_tokens=128, top_k=8, capacity_factor=1.5
    )
    # Balanced: 128 * 8 / 8 = 128 per peer -> 192; 128 * 8 / 8 local experts = 128 -> 192.
    assert (default.peer_capacity, default.expert_capacity) == (192, 192)
    worst = ep_config.create_ep_dispatcher(
        mesh, num_experts=64, num_tokens=128, top_k=8, worst_case=True
    )
    assert worst.peer_capacity == 128 * 8 and worst.expert_capacity == 128 * 8
    tiny = ep_config.create_ep_dispatcher(mesh, num_experts=16, num_tokens=2, top_k=4)
    assert tiny.peer_capacity == tiny.worst_peer_capacity == 4  # capped at the worst case
    with pytest.raises(ValueError, match="num_experts=12"):
        ep_config.create_ep_dispatcher(mesh, num_experts=12, num_tokens=4, top_k=2)
    with pytest.raises(ValueError, match="exchange="):
        ep_config.create_ep_dispatcher(mesh, num_experts=16, num_tokens=4, top_k=2, exchange="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="ragged_all_to_all needs a GPU")
def test_dense_ragged_and_peer_copy_agree_on_gpu():
    num_devices = len(jax.devices())
    mesh = mesh_lib.make_mesh(num_devices, 1)
    rng = np.random.default_rng(4)
    tokens, top_k, num_experts = 32, 2, 4 * num_devices
    hidden = rng.standard_normal((num_devices * tokens, HIDDEN)).astype(np.float32)
    ids = np.stack(
        [rng.choice(num_experts, top_k, replace=False) for _ in range(num_devices * tokens)]
    ).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (num_devices * tokens, top_k)).astype(np.float32)
    num_valid = rng.integers(0, tokens + 1, num_devices).astype(np.int32)
    results = {}
    for exchange in ("dense", "ragged", "peer_copy"):
        dispatcher = ep_config.create_ep_dispatcher(
            mesh, num_experts=num_experts, num_tokens=tokens, top_k=top_k, exchange=exchange
        )
        shard = P(mesh_lib.TP_AXES)
        step = jax.jit(
            jax.shard_map(
                functools.partial(_moe_step, dispatcher, True),
                mesh=mesh,
                in_specs=(shard,) * 4,  # hidden, topk ids, weights, valid counts
                out_specs=(shard,) * 3,
                check_vma=False,
            )
        )
        results[exchange] = [np.asarray(x) for x in step(hidden, ids, weights, num_valid)]
    for other in ("ragged", "peer_copy"):
        for dense, result in zip(results["dense"], results[other], strict=True):
            np.testing.assert_allclose(dense, result, rtol=1e-5, atol=1e-5)
    valid = np.arange(tokens)[None, :] < num_valid[:, None]
    want = (weights * (ids + 1)).sum(-1, keepdims=True) * hidden * valid.reshape(-1, 1)
    if results["dense"][1].sum() == 0:
        np.testing.assert_allclose(results["ragged"][0], want, rtol=1e-4, atol=1e-4)


def _peak_step(dispatcher, hidden, ids, weights, num_valid):
    in_flight = ep_dispatch.dispatch_a(dispatcher, hidden, ids, weights, num_valid[0])
    _, state = ep_dispatch.dispatch_b(dispatcher, in_flight)
    return state.peak_load


def reference_peaks(ids, num_valid, peer_capacity):
    """Per device: the most assignments bound for one peer, and received for one local expert."""
    local = NUM_EXPERTS // NUM_DEVICES
    peaks = np.zeros((NUM_DEVICES, 2), np.int64)
    received = np.zeros((NUM_DEVICES, local), np.int64)
    for d in range(NUM_DEVICES):
        per_peer = np.zeros(NUM_DEVICES, np.int64)
        for t in range(num_valid[d]):
            for e in ids[d, t]:
                if 0 <= e < NUM_EXPERTS:
                    per_peer[e // local] += 1
                    if per_peer[e // local] <= peer_capacity:  # kept: reaches the expert
                        received[e // local, e % local] += 1
        peaks[d, 0] = per_peer.max()
    peaks[:, 1] = received.max(axis=1)
    return peaks


@pytest.mark.parametrize("skew, peer_capacity", [(False, 4), (True, 3), (True, None)])
def test_peak_load_is_the_capacity_each_dispatch_needed(skew, peer_capacity):
    rng = np.random.default_rng(7 + (peer_capacity or 0))
    hidden, ids, weights, num_valid = routing(rng, skew=skew)
    mesh = harness.mesh(8, 1)
    dispatcher = ep_config.create_ep_dispatcher(
        mesh, num_experts=NUM_EXPERTS, num_tokens=TOKENS, top_k=TOP_K,
        worst_case=peer_capacity is None,
    )  # fmt: skip
    if peer_capacity is not None:
        dispatcher = dataclasses.replace(dispatcher, peer_capacity=peer_capacity, expert_capacity=2)
    shard = P(mesh_lib.TP_AXES)
    step = jax.jit(
        jax.shard_map(
            functools.partial(_peak_step, dispatcher),
            mesh=mesh,
            in_specs=(shard, shard, shard, shard),  # hidden, topk ids, weights, valid counts
            out_specs=shard,  # peak_load [2] per device
            check_vma=False,
        )
    )
    got = step(
        hidden.reshape(-1, HIDDEN), ids.reshape(-1, TOP_K), weights.reshape(-1, TOP_K), num_valid
    )
    want = reference_peaks(ids, num_valid, dispatcher.peer_capacity)
    np.testing.assert_array_equal(harness.per_device(got, NUM_DEVICES), want)
