"""Out of KV space under load: generate queues what does not fit and drops nothing.

120 random short prompts (and two that can never fit) go through a pool of 24 KV slots and 3
request rows per DP rank, TBO off and on; every servable prompt's tokens must equal those of
a run whose pool holds every request at once, and the two oversized prompts are refused in
their results while the others complete.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import model as model_lib
from jtbo.runner import admission, tbo_options
from jtbo.runner import runner as runner_lib
from tests.runner import helpers

NEW_TOKENS = 3
SMALL = dict(max_total_tokens=24, max_running_requests=3, token_buckets=(16,))
LARGE = dict(max_total_tokens=1024, max_running_requests=128, token_buckets=(16, 128))
TOO_LONG = {17: 22, 45: 30}  # prompt index -> length: + NEW_TOKENS > 24 slots
# One dense and one MoE layer: the queueing is what is checked, not the model's depth.
CONFIG = helpers.TWO_LAYER_TINY


def _prompts():
    rng = np.random.default_rng(20)
    prompts = [rng.integers(0, 128, int(n)).tolist() for n in rng.integers(1, 9, 120)]
    for index, length in TOO_LONG.items():
        prompts.insert(index, rng.integers(0, 128, length).tolist())
    return prompts


@pytest.fixture(scope="module")
def outputs():
    """{"large": results, False: small-pool results, True: small-pool TBO results}."""
    model = model_lib.MoEModel(CONFIG, rngs=nnx.Rngs(2))
    mesh = mesh_lib.make_mesh(2, 1)
    prompts, out = _prompts(), {}
    for key, tbo, pool in (("large", False, LARGE), (False, False, SMALL), (True, True, SMALL)):
        runner = runner_lib.ModelRunner(
            model,
            mesh,
            tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo),
            dtype=jnp.float32,
            **pool,
        )
        out[key] = runner.generate(prompts, max_new_tokens=NEW_TOKENS, chunk_size=16)
        out[f"{key}/steps"] = runner.num_steps
    return out


@pytest.mark.parametrize("tbo", [False, True])
def test_a_small_pool_queues_requests_and_gives_the_large_pool_tokens(outputs, tbo):
    small, large = outputs[tbo], outputs["large"]
    assert len(small) == len(large) == 122
    for index, (got, want) in enumerate(zip(small, large, strict=True)):
        if index in TOO_LONG:
            assert got.token_ids == [] and "exceeds the KV budget of 24 tokens" in got.error
            continue
        assert got.error is None and want.error is None, (index, got.error)
        assert got.token_ids == want.token_ids, index
        assert len(got.token_ids) == NEW_TOKENS
    assert outputs[f"{tbo}/steps"] > 3 * outputs["large/steps"]  # it did queue


def test_running_requests_are_capped_by_rows_and_the_largest_bucket():
    assert admission.running_limit(8, (4, 16)) == 8
    assert admission.running_limit(64, (4, 16)) == 16


def test_the_queue_admits_in_order_as_slots_free():
    rank = admission.RankQueue(max_reqs=4, num_slots=11, limit=3)  # 10 usable slots
    for index, length in enumerate([4, 4, 1, 1]):
        rank.waiting.append((index, np.arange(length), index))  # (index, prompt, request id)
    rank.admit(max_new_tokens=2)  # 6 + 6 > 10: the second waits, and the third behind it
    assert [r.index for r in rank.running] == [0] and len(rank.waiting) == 3
    rank.release(rank.running[0])
    rank.admit(max_new_tokens=2)  # 6 + 3 <= 10; the fourth's 3 > 1 slot left: it waits
    assert [r.index for r in rank.running] == [1, 2] and len(rank.waiting) == 1
    slots = np.concatenate([r.slots for r in rank.running])
    assert len(set(slots.tolist())) == slots.size and slots.min() >= 1
