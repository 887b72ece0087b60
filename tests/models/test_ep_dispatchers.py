"""EP dispatchers per micro-batch and the host overflow policies (raise / rerun)."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtbo.collectives import ep_overflow
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import ep_dispatchers, layer_ops
from jtbo.models import model as model_lib
from jtbo.runner import runner as runner_lib
from tests.runner import helpers


def _table(policy="rerun", factor=1.0, backend="ep"):
    mesh = mesh_lib.make_mesh(4, 2)
    moe = layer_ops.MoEOptions(
        moe_a2a_backend=backend, moe_runner_backend="xla", ep_capacity_factor=factor,
        ep_overflow_policy=policy,
    )  # fmt: skip
    parallel = layer_ops.ParallelConfig.for_mesh(mesh, moe=moe)
    return ep_dispatchers.DispatcherTable(mesh, config_lib.MoEConfig.tiny(), parallel)


def test_one_dispatcher_per_micro_batch_sized_by_its_rows():
    table = _table()
    (plain,) = table.for_step(32, None)
    a, b = table.for_step(32, 18)
    assert plain.num_tokens == 16 and a.num_tokens == b.num_tokens == 9  # rows / attn_tp
    # Balanced: 16 rows * top_k 2 / 8 peers per peer; 16 * 2 / 1 local expert per expert.
    assert (plain.peer_capacity, plain.expert_capacity) == (4, 32)
    assert _table(factor=None).dispatcher(16).peer_capacity == 16  # worst case: top_k 2 > 1 local
    assert _table(backend="none").for_step(32, 18) == ()


def test_rerun_raises_only_the_overflowed_capacity_and_remembers_it():
    table = _table()
    step = table.for_step(32, 18)
    assert table.resolve(step, np.zeros((2, 2), np.int32)) is None
    rerun = table.resolve(step, np.array([[3, 0], [0, 1]]))  # A: peer; B: expert
    peer = step[0].peer_capacity * 2  # A's overflowed peer capacity doubles (3 -> 6)
    # B's doubles too, capped by what its peers could send (8 peers x its peer capacity 3).
    expert = min(step[0].expert_capacity * 2, 8 * step[1].peer_capacity)
    want = (peer, expert)
    assert [(d.peer_capacity, d.expert_capacity) for d in rerun] == [want, want]
    assert table.for_step(32, 18) == rerun  # later steps start from the raised capacities
    with pytest.raises(ValueError, match="must end in"):
        table.resolve(step, np.zeros((2,), np.int32))


def test_rerun_sizes_on_the_step_peak_loads():
    table = _table()
    step = table.for_step(64, 34)  # two micro-batches of 17 rows per device
    peer = step[0].peer_capacity
    peaks = np.array([[peer + 2, 1], [peer - 1, 1]])  # A needed 2 peer slots more
    rerun = table.resolve(step, np.array([[2, 0], [0, 0]]), peaks)
    alignment = table.parallel.moe.ep_slot_alignment
    want = ep_overflow.next_capacity_bucket(peer, step[0].worst_peer_capacity, alignment, peer + 2)
    doubled = ep_overflow.next_capacity_bucket(peer, step[0].worst_peer_capacity, alignment)
    assert want < doubled  # sized on the peak, not doubled
    assert [d.peer_capacity for d in rerun] == [want, want]


def test_measured_peaks_size_those_rows_and_observed_peaks_are_recorded():
    table = _table(factor=4.0)
    table.use_measured_peaks({9: (5, 11)})
    measured, other = table.dispatcher(9), table.dispatcher(16)
    # headroom 1.25 over the peaks, rounded up (alignment 1); other sizes keep the factor rule
    assert (measured.peer_capacity, measured.expert_capacity) == (7, 14)
    assert (other.peer_capacity, other.expert_capacity) == (16, 128)
    with pytest.raises(ValueError, match="already built"):
        table.use_measured_peaks({16: (1, 1)})
    a, b = table.for_step(32, 18)
    table.observe((a, b), np.array([[[3, 4], [6, 2]], [[5, 1], [2, 9]]]))  # [ranks, mb, 2]
    table.observe((a, b), np.array([[1, 1], [1, 1]]))
    # both micro-batches have 9 rows: one entry, the max over ranks and micro-batches
    assert table.observed_peaks() == {9: (6, 9)}


def test_raise_names_the_capacity():
    table = _table(policy="raise")
    with pytest.raises(ep_overflow.CapacityOverflowError, match="peer_capacity=4"):
        table.resolve(table.for_step(32, None), np.array([[5, 0]]))


def test_runner_rerun_policy_matches_the_worst_case_capacity():
    config = config_lib.MoEConfig.tiny()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    make = lambda factor, policy: runner_lib.ModelRunner(  # noqa: E731
        model, mesh_lib.make_mesh(8, 1), max_total_tokens=32, max_running_requests=2,
        token_buckets=(16,), dtype=jnp.float32,
        moe=layer_ops.MoEOptions(ep_capacity_factor=factor, ep_overflow_policy=policy),
    )  # fmt: skip
    prompt = {0: np.random.default_rng(2).integers(0, 128, 16).tolist()}
    small, exact = make(0.01, "rerun"), make(None, "raise")
    got = small.forward([helpers.Rank().extend(prompt)] + [None] * 7)[0]
    want = exact.forward([helpers.Rank().extend(prompt)] + [None] * 7)[0]
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    (raised,) = small.engine.step.dispatchers.for_step(16, None)
    assert raised.peer_capacity > 1 and small.engine.step.num_keys > 1  # it did re-run


def test_merge_peaks_takes_the_larger_peak():
    merged = ep_dispatchers.merge_peaks({8: (5, 9), 16: (1, 1)}, {8: (7, 2)})
    assert merged == {8: (7, 9), 16: (1, 1)}
