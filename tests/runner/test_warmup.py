"""``warmup``: the synthetic plans that compile a runner's programs ahead of serving."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jtbo import split
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.runner import planning, runner_config, tbo_options, warmup

EXTEND, DECODE = split.ForwardMode.EXTEND, split.ForwardMode.DECODE


def _config(switch=True) -> runner_config.RunnerConfig:
    model = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=1)
    return runner_config.resolve(
        model, mesh_lib.make_mesh(2, 1), max_total_tokens=64, max_running_requests=8,
        dtype=jnp.float32, tbo=tbo_options.TboOptions(enable_two_batch_overlap=switch),
    )  # fmt: skip


@pytest.mark.parametrize(("count", "num_seqs"), [(10, 3), (7, 7), (16, 1)])
def test_synthetic_batches_touch_only_the_padding_slot(count, num_seqs):
    batch = warmup.synthetic_batch(EXTEND, count, num_seqs)
    lens = np.asarray(batch.extend_seq_lens)
    assert lens.sum() == count and lens.max() - lens.min() <= 1 and len(lens) == num_seqs
    for field in ("input_ids", "positions", "out_cache_loc", "req_pool_indices"):
        assert not np.asarray(getattr(batch, field)).any(), field
    decode = warmup.synthetic_batch(DECODE, count, num_seqs)
    assert decode.batch_size == count and not np.asarray(decode.out_cache_loc).any()


def test_a_tbo_shape_warms_its_child_capacity_and_every_larger_one():
    config = _config()
    plans = warmup.warmup_plans(config, 16, EXTEND, 2, tbo=True, outputs="logits")
    children = [plan.child_capacity for plan in plans]
    options = dataclasses.replace(config.plan, dp_padding="max_len")
    every = planning.child_capacities(16, plans[0].mode, None, options)
    assert children[0] is not None and children == [c for c in every if c >= children[0]]
    assert {plan.capacity for plan in plans} == {16}
    (plain,) = warmup.warmup_plans(config, 16, EXTEND, 2, tbo=False, outputs="logits")
    assert plain.child_capacity is None and plain.per_rank.token_source is None
    tokens = warmup.warmup_plans(config, 16, DECODE, 16, tbo=False, outputs="tokens")
    assert all(plan.per_rank.token_source is not None for plan in tokens)


def test_bad_arguments_are_refused():
    config = _config(False)
    with pytest.raises(ValueError, match="outputs must be 'logits' or 'tokens'"):
        warmup.check_arguments(config, (1,), "probs")
    with pytest.raises(ValueError, match=r"seq_counts \[0, 9\] outside \[1, max_running"):
        warmup.check_arguments(config, (0, 1, 9), "logits")
