"""capacity_slots: each pair's slot, the counts and the slot tokens (xla and pallas; the Pallas
interpreter on the CPU) against a numpy loop over the pairs."""

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import aot, kernels
from jtbo.kernels import capacity_routing
from tests.kernels import helpers


def _numpy_slots(ids: np.ndarray, num_experts: int, capacity: int):
    """(position, counts, slot_token) by walking the pairs in token-major order."""
    seen = np.zeros(num_experts, np.int64)
    position = np.zeros(ids.size, np.int32)
    token = np.full((num_experts, capacity), -1, np.int32)
    for pair, expert in enumerate(ids.reshape(-1)):
        if not 0 <= expert < num_experts:
            continue
        position[pair] = seen[expert]
        if seen[expert] < capacity:
            token[expert, seen[expert]] = pair // ids.shape[1]
        seen[expert] += 1
    return position.reshape(ids.shape), np.minimum(seen, capacity).astype(np.int32), token


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    num_tokens=st.integers(1, 70),
    top_k=st.integers(1, 8),
    num_experts=st.sampled_from([3, 8, 20, 128]),
    capacity=st.integers(1, 40),
)
def test_slots_match_a_walk_over_the_pairs(impl, seed, num_tokens, top_k, num_experts, capacity):
    # Random ids with out-of-range ones (-1 and E, which take no slot); hot experts overflow
    # small capacities. Several chunks of pairs, experts padded to a power of two.
    rng = np.random.default_rng(seed)
    hot = rng.integers(0, num_experts, 3)
    ids = np.where(
        rng.random((num_tokens, top_k)) < 0.4,
        rng.choice(hot, (num_tokens, top_k)),
        rng.integers(-1, num_experts + 1, (num_tokens, top_k)),
    ).astype(np.int32)
    got = capacity_routing.capacity_slots(jnp.asarray(ids), num_experts, capacity, impl=impl)
    position, counts, token = _numpy_slots(ids, num_experts, capacity)
    chex.assert_trees_all_equal(
        (got.position, got.counts, got.slot_token), (position, counts, token)
    )
    inside = (ids >= 0) & (ids < num_experts)
    np.testing.assert_array_equal(
        np.asarray(got.valid(jnp.asarray(ids))), inside & (position < capacity)
    )


def test_many_pairs_spread_over_many_programs():
    # 1200 pairs: the kernel's grid has many chunks, each walking all of them.
    ids = np.random.default_rng(3).integers(0, 64, (150, 8)).astype(np.int32)
    got = capacity_routing.capacity_slots(jnp.asarray(ids), 64, 24, impl="pallas")
    chex.assert_trees_all_equal(
        (got.position, got.counts, got.slot_token), _numpy_slots(ids, 64, 24)
    )


def test_impl_none_takes_xla_past_the_kernel_bound(monkeypatch):
    calls = []
    monkeypatch.setattr(
        capacity_routing, "capacity_slots_pallas", lambda *args: calls.append(args) or None
    )
    monkeypatch.setattr(capacity_routing.impls, "backend", lambda: "gpu")
    many = jnp.zeros((capacity_routing.KERNEL_MAX_PAIRS // 4 + 1, 4), jnp.int32)
    got = capacity_routing.capacity_slots(many, 4, 8)
    assert not calls and int(got.counts[0]) == 8
    capacity_routing.capacity_slots(many[:2], 4, 8)
    assert len(calls) == 1


def test_bad_inputs_are_refused():
    ids = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"\[T, k\] integers"):
        capacity_routing.capacity_slots(ids.reshape(-1), 4, 2)
    with pytest.raises(ValueError, match=r"\[T, k\] integers"):
        capacity_routing.capacity_slots(ids.astype(jnp.float32), 4, 2)
    with pytest.raises(ValueError, match="capacity >= 0"):
        capacity_routing.capacity_slots(ids, 4, -1)
    with pytest.raises(kernels.KernelUnavailableError, match="impl='triton'"):
        capacity_routing.capacity_slots(ids, 4, 2, impl="triton")
    empty = capacity_routing.capacity_slots(ids, 4, 0, impl="pallas")
    assert empty.slot_token.shape == (4, 0) and not np.asarray(empty.counts).any()


@pytest.mark.parametrize("num_tokens, num_experts, capacity", [(64, 128, 16), (512, 256, 64)])
def test_kernel_compiles_for_an_h200_on_the_cpu(num_tokens, num_experts, capacity):
    # The Triton lowering (the running count, the scattered stores) compiled by XLA for a
    # described H200 (jtbo.aot): Qwen3-30B-A3B's and DeepSeek-V3's experts at decode sizes.
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    route = functools.partial(
        capacity_routing.capacity_slots_pallas, num_experts=num_experts, capacity=capacity,
        interpret=False,
    )  # fmt: skip
    hlo = helpers.compiled_for_h200(route, [((num_tokens, 8), jnp.int32)])
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 1
