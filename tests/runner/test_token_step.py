"""Token steps (``ModelRunner.dispatch`` / ``resolve``) and the pipelined ``generate``: the
device page table against a host reference, tokens against the unsharded model, EP re-runs and
the numerics guard one step late, and a decode step's host traffic independent of the pool."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo import split
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import layer_ops
from jtbo.models import model as model_lib
from jtbo.runner import kv_table, numerics, token_step
from jtbo.runner import runner as runner_lib
from tests.runner import helpers

CONFIG = helpers.TWO_LAYER_TINY  # one MoE layer
ROWS = 4


@pytest.fixture(scope="module")
def model():
    return model_lib.MoEModel(CONFIG, rngs=nnx.Rngs(4))


def _runner(model) -> runner_lib.ModelRunner:
    """A runner of ``model`` on 2 x 1 devices. Every test of this file that needs no other
    mesh, pool or bucket takes these settings: their token programs are then the same, compiled
    once (the run's compilation cache) and loaded by each later runner."""
    return runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(2, 1), max_total_tokens=4096, max_running_requests=ROWS,
        max_context_len=48, token_buckets=(16,), dtype=jnp.float32,
    )  # fmt: skip


@pytest.fixture(scope="module")
def table_runner(model):
    return _runner(model)


class _Session:
    """Requests of every rank, their slots, and the host reference of the page table."""

    def __init__(self, runner):
        self.runner = runner
        self.host = np.asarray(runner.req_to_token).copy()  # [dp, rows, max_context]
        self.filled = runner.kv_filled.copy()
        self.ranks = [helpers.Rank() for _ in range(runner.dp_size)]
        for rank in self.ranks:  # slots past every earlier example's
            rank.next_slot = 1 + int(self.host.max())

    def batch(self, rank: int, op: str, row: int, length: int):
        """A batch of ``op`` on request row ``row``, or None when it does not apply."""
        state = self.ranks[rank]
        known = row in state.tokens
        if op == "admit" or (op == "extend" and not known):
            state.tokens.pop(row, None)  # a new request in this row, from position 0
            return state.extend({row: list(range(1, length + 1))})
        if op == "finish":
            state.tokens.pop(row, None)
            return None
        if not known or len(state.tokens[row]) + length > 46:
            return None
        if op == "extend":
            return state.extend({row: [5] * length})
        return state.decode({row: 7})

    def step(self, batches):
        for rank, batch in enumerate(batches):
            if batch is not None:
                kv_table.record(self.host[rank], batch, self.runner.num_slots, self.filled[rank])
        pending = self.runner.dispatch(batches)
        return self.runner.resolve(pending)


OPS = st.tuples(
    st.integers(0, 1), st.sampled_from(["admit", "extend", "decode", "finish"]),
    st.integers(0, ROWS - 1), st.integers(1, 6),
)  # fmt: skip


@settings(max_examples=8, deadline=None)
@given(st.lists(st.lists(OPS, min_size=1, max_size=2), min_size=1, max_size=6))
def test_the_device_page_table_follows_the_host_reference(table_runner, steps):
    # Random admit / extend / decode / finish steps over two DP ranks: after each, the device
    # table equals the numpy table ``kv_table.record`` wrote (every position, every row).
    session = _Session(table_runner)
    for ops in steps:
        batches = [None, None]
        for rank, op, row, length in ops:
            if batches[rank] is None:
                batches[rank] = session.batch(rank, op, row, length)
        session.step(batches)
        np.testing.assert_array_equal(np.asarray(table_runner.req_to_token), session.host)
        np.testing.assert_array_equal(table_runner.kv_filled, session.filled)


def test_token_steps_equal_the_reference_and_read_the_last_steps_tokens(table_runner, model):
    # Step 2's decode ids come from step 1's device tokens (token_sources), not the host.
    rank = helpers.Rank()
    prompt = {0: [3, 9, 4, 1], 1: [8, 2]}
    first = table_runner.dispatch([rank.extend(prompt), None])
    want = helpers.reference_new_rows(model, rank, {0: 4, 1: 2})
    # Greedy tokens of each sequence's last row, read from the devices only now.
    decode = rank.decode({0: 0, 1: 0})  # placeholder ids, replaced on the devices
    second = table_runner.dispatch(
        [decode, None], token_sources=[np.array([0, 1]), None], after=first
    )
    tokens = table_runner.resolve(first)[0].tokens
    np.testing.assert_array_equal(tokens, [np.argmax(want[3]), np.argmax(want[5])])
    rank.tokens[0][-1], rank.tokens[1][-1] = int(tokens[0]), int(tokens[1])
    again = helpers.reference_new_rows(model, rank, {0: 1, 1: 1})
    np.testing.assert_array_equal(table_runner.resolve(second)[0].tokens, np.argmax(again, -1))
    with pytest.raises(ValueError, match="pass after="):
        table_runner.dispatch([rank.decode({0: 1}), None], token_sources=[np.array([0]), None])


def test_pipelined_generate_reruns_overflowed_steps_as_the_synchronous_loop(model):
    # A tiny EP capacity overflows: the step re-runs (and so does the step dispatched after
    # it, which read its tokens); tokens equal the synchronous loop's and a roomy runner's.
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CONFIG.vocab_size, int(n)).tolist() for n in rng.integers(2, 9, 6)]
    results = {}
    for name, factor, pipeline in (
        ("tight", 0.3, True),
        ("sync", 0.3, False),
        ("roomy", None, True),
    ):
        runner = runner_lib.ModelRunner(
            model, mesh_lib.make_mesh(2, 2), max_total_tokens=128, max_running_requests=ROWS,
            token_buckets=(16,), dtype=jnp.float32,
            moe=layer_ops.MoEOptions(ep_capacity_factor=factor, ep_overflow_policy="rerun"),
        )  # fmt: skip
        out = runner.generate(prompts, max_new_tokens=5, chunk_size=8, pipeline=pipeline)
        results[name] = ([r.token_ids for r in out], runner.num_reruns)
    assert results["tight"][1] > 0 and results["roomy"][1] == 0
    assert results["tight"][0] == results["sync"][0] == results["roomy"][0]


def test_a_non_finite_step_raises_naming_the_step_in_both_loops():
    poisoned = model_lib.MoEModel(CONFIG, rngs=nnx.Rngs(4))
    poisoned.embed.table[...] = poisoned.embed.table[...].at[77].set(jnp.nan)
    runner = _runner(poisoned)
    for pipeline in (True, False):
        with pytest.raises(numerics.NonFiniteLogitsError, match=r"^step \d+: DP rank 1: "):
            runner.generate([[1, 2], [3, 4, 77]], max_new_tokens=3, pipeline=pipeline)


def test_a_request_longer_than_max_context_len_is_refused_in_its_own_result(table_runner):
    out = table_runner.generate([[1] * 40, [2, 3], [4] * 50], max_new_tokens=4)
    assert out[0].error is None and len(out[0].token_ids) == 4 and len(out[1].token_ids) == 4
    assert out[2].token_ids == [] and "max_context_len=48" in out[2].error


def _decode_traffic(model, pool: int, rows: int) -> int:
    """Host->device bytes of one decode step after warm-up (the plan; the page table stays)."""
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(1, 1, devices=jax.devices()[:1]), max_total_tokens=pool,
        max_running_requests=rows, max_context_len=32, token_buckets=(8,), dtype=jnp.float32,
    )  # fmt: skip
    rank = helpers.Rank()
    runner.resolve(runner.dispatch([rank.extend({0: [1, 2, 3], 1: [4, 5]})]))
    runner.resolve(runner.dispatch([rank.decode({0: 6, 1: 7})]))  # compiles the decode step
    put, device_put = [], jax.device_put

    def recording_put(x, *args, **kwargs):
        put.append(x)
        return device_put(x, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, jax.transfer_guard_host_to_device("disallow"):
        patch.setattr(jax, "device_put", recording_put)
        runner.resolve(runner.dispatch([rank.decode({0: 8, 1: 9})]))
    return sum(leaf.nbytes for leaf in jax.tree.leaves(put))


def test_a_decode_steps_host_traffic_does_not_grow_with_the_pool(model):
    small, large = _decode_traffic(model, 4096, ROWS), _decode_traffic(model, 524288, ROWS)
    assert small == large and 0 < small < 4096
    # More request rows add only their sampling and token rows (4 bytes each), never a table.
    assert _decode_traffic(model, 4096, 4 * ROWS) - small < 64 * ROWS


def test_row_sampling_refuses_bad_parameters():
    with pytest.raises(ValueError, match="one 1-D shape"):
        token_step.RowSampling(*[np.zeros(2)] * 4, np.zeros(3))
    with pytest.raises(ValueError, match="top_p"):
        token_step.RowSampling(np.ones(1), np.zeros(1), *[np.zeros(1, np.int32)] * 3)


def test_warmup_of_token_programs_leaves_generate_nothing_to_compile(model):
    runner = _runner(model)
    modes = [split.ForwardMode.EXTEND, split.ForwardMode.DECODE]
    warm = runner.warmup([16], modes, seq_counts=(1, ROWS), outputs="tokens")
    assert warm == 2  # the extend program (one sequence bucket for both counts) and decode
    runner.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_new_tokens=3, chunk_size=8)
    assert runner.compile_count == warm
    with pytest.raises(ValueError, match="outputs must be"):
        runner.warmup([16], modes, outputs="ids")


def test_bad_token_step_inputs_are_refused_before_the_batches_are_recorded(table_runner):
    rank = helpers.Rank()
    first = table_runner.dispatch([rank.extend({0: [1, 2, 3]}), None])
    filled = table_runner.kv_filled.copy()
    decode = rank.decode({0: 0})
    with pytest.raises(ValueError, match=r"outside \[-1, 4\)"):
        table_runner.dispatch([decode, None], token_sources=[np.array([9]), None], after=first)
    with pytest.raises(ValueError, match="one row per sequence"):
        bad = token_step.RowSampling(*[np.ones(2, np.float32)] * 2, *[np.zeros(2, np.int32)] * 3)
        table_runner.dispatch([decode, None], sampling=[bad, None])
    np.testing.assert_array_equal(table_runner.kv_filled, filled)  # nothing was recorded
    table_runner.resolve(first)
