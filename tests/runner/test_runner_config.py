"""``runner_config.resolve``: every option decided once, in a frozen object with no None left."""

import dataclasses
import inspect

import jax.numpy as jnp
import pytest

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import layer_ops
from jtbo.runner import runner_config, step_exchange, tbo_auto, tbo_options, tbo_plan_file

# The one None a resolved config keeps: a choice (the worst-case EP capacity), not a default.
CHOSEN_NONE = {"parallel.moe.ep_capacity_factor"}


def _nones(value, path: str = "") -> set[str]:
    """The paths of every None inside ``value`` (dataclasses and tuples, recursively)."""
    if value is None:
        return {path}
    if dataclasses.is_dataclass(value):
        children = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, tuple):
        children = ((str(i), item) for i, item in enumerate(value))
    else:
        return set()
    return set().union(*(_nones(v, f"{path}.{k}" if path else k) for k, v in children))


def _resolve(mesh=(2, 2), **kwargs) -> runner_config.RunnerConfig:
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=1)
    sizes = dict(max_total_tokens=48, max_running_requests=3) | kwargs
    return runner_config.resolve(config, mesh_lib.make_mesh(*mesh), dtype=jnp.float32, **sizes)


@pytest.mark.parametrize("switch", [False, True, "auto"])
def test_defaults_resolve_to_a_config_with_no_none(switch):
    resolved = _resolve(tbo=tbo_options.TboOptions(enable_two_batch_overlap=switch))
    options = {f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved)}
    del options["model"]  # the model's own config: its None fields describe the model
    assert set().union(*(_nones(v, k) for k, v in options.items())) == CHOSEN_NONE
    moe = resolved.parallel.moe
    assert moe.moe_runner_backend == moe.moe_runner_backend_tbo == "xla"  # the CPU's
    assert moe.ep_exchange_tbo == moe.ep_exchange == "dense"
    assert resolved.parallel.tbo_issue_barriers is False  # attn_tp_size 2: off by default
    assert resolved.plan.token_buckets == (1, 2, 4, 8, 16, 32, 48)
    assert resolved.max_context_len == 48  # the tiny model states no trained length
    assert resolved.tbo_auto.timer is tbo_auto.wall_timer and resolved.auto == (switch == "auto")
    assert (resolved.dp_size, resolved.num_slots, resolved.local_dp_ranks) == (2, 49, (0, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.max_total_tokens = 1


def test_the_fingerprint_leaves_out_the_timer_the_plan_path_and_the_own_ranks(tmp_path):
    # Processes share the decisions of a plan file, not its path, and time with their own
    # timers; each drives other ranks. None of that may make their fingerprints differ.
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    tbo_plan_file.save(first, [])
    tbo_plan_file.save(second, [])

    def fingerprint(plan, timer, ranks=None) -> int:
        tbo = tbo_options.TboOptions(
            enable_two_batch_overlap="auto", tbo_plan=plan, tbo_timer=timer
        )
        resolved = _resolve(tbo=tbo)
        if ranks is not None:
            resolved = dataclasses.replace(resolved, local_dp_ranks=ranks)
        return step_exchange.fingerprint(*resolved.fingerprint_parts(range(4), (2, 2)))

    base = fingerprint(first, lambda shape, use_tbo, run: 1.0)
    assert fingerprint(second, lambda shape, use_tbo, run: 2.0, ranks=(1,)) == base
    other = tbo_options.TboOptions(enable_two_batch_overlap="auto", tbo_auto_trials=5)
    assert (
        step_exchange.fingerprint(*_resolve(tbo=other).fingerprint_parts(range(4), (2, 2))) != base
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_total_tokens=0), "max_total_tokens=0"),
        (dict(max_context_len=100), "max_context_len=100"),
        (dict(mesh=(3, 1)), "does not divide over 3 devices"),
        (dict(dp_padding="sum_len"), "dp_padding='sum_len' needs moe_a2a_backend='none'"),
        (dict(ep_routing_stats="stats.json", moe=layer_ops.MoEOptions(moe_a2a_backend="none")),
         "moe_a2a_backend='none' has none"),
    ],
)  # fmt: skip
def test_bad_set_ups_are_refused_before_any_weights(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _resolve(**kwargs)


def test_the_runner_takes_exactly_resolves_options_with_the_same_defaults():
    # ModelRunner spells its keywords out for its users and hands them to resolve: the two
    # signatures must not drift apart.
    from jtbo.runner import runner as runner_lib  # noqa: PLC0415 - the layer above

    def keywords(function, leave_out):
        parameters = inspect.signature(function).parameters.values()
        return [(p.name, p.default) for p in parameters if p.name not in leave_out]

    runner_side = keywords(
        runner_lib.ModelRunner.__init__, ("self", "model", "mesh", "params_from")
    )
    assert runner_side == keywords(runner_config.resolve, ("model", "mesh"))
