"""End-to-end: ModelRunner with TBO on and off vs the unsharded reference forward (float32).

Tolerance: float32 end to end through 3 layers; different summation orders (sharded heads,
psum, capacity slots) give ~1e-6 differences, so atol = rtol = 2e-4.
"""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtbo import split
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import layer_ops
from jtbo.models import model as model_lib
from jtbo.runner import planning, tbo_options, tbo_plan_file
from jtbo.runner import runner as runner_lib
from tests.runner import helpers

TOL = dict(atol=2e-4, rtol=2e-4)


def _runners(dp, tp, backend, config=None):
    config = config or config_lib.MoEConfig.tiny()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    mesh = mesh_lib.make_mesh(dp, tp)
    make = lambda tbo: runner_lib.ModelRunner(  # noqa: E731
        model, mesh, tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo),
        moe=layer_ops.MoEOptions(moe_a2a_backend=backend), max_total_tokens=64,
        max_running_requests=4, token_buckets=(8, 16, 32), dtype=jnp.float32,
    )  # fmt: skip
    return model, make(False), make(True)


def _prompts(rng, lens):
    return {row: rng.integers(0, 128, n).tolist() for row, n in enumerate(lens)}


@pytest.mark.parametrize("dp, tp, backend", [(8, 1, "ep"), (4, 2, "none"), (2, 4, "ep")])
def test_extend_with_prefix_and_two_chunk_matches_reference(dp, tp, backend):
    model, plain, tbo = _runners(dp, tp, backend)
    rng = np.random.default_rng(dp)
    # Rank 0: balanced split; rank 1: one long prompt (two-chunk split); last rank idle.
    lens = ([[5, 3, 4], [14]] + [[2, 6]] * (dp - 3) + [None])[:dp]
    ranks = [helpers.Rank() for _ in range(dp)]
    for step in range(2):  # step 2 extends every request again: prefixes from step 1
        new = [None if n is None else _prompts(rng, n) for n in lens]
        batches = [None if n is None else r.extend(n) for r, n in zip(ranks, new, strict=True)]
        outs = [runner.forward(batches) for runner in (plain, tbo)]
        for r, n in enumerate(new):
            if n is None:
                assert outs[0][r] is None and outs[1][r] is None
                continue
            want = helpers.reference_new_rows(model, ranks[r], {k: len(v) for k, v in n.items()})
            chex.assert_trees_all_close(outs[0][r], want, **TOL)
            chex.assert_trees_all_close(outs[1][r], want, **TOL)
        assert tbo.num_tbo_steps == step + 1 and plain.num_tbo_steps == 0


def test_decode_and_target_verify_match_reference():
    model, plain, tbo = _runners(4, 2, "ep")
    rng = np.random.default_rng(1)
    lens = [[4, 6, 3], [5, 2], [7], None]
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # root with two children
    for runner in (plain, tbo):
        ranks = [helpers.Rank() for _ in range(4)]
        prompts = [None if n is None else _prompts(np.random.default_rng(7), n) for n in lens]
        runner.forward(
            [None if p is None else r.extend(p) for r, p in zip(ranks, prompts, strict=True)]
        )
        for _ in range(2):
            tokens = [
                None if p is None else {k: int(rng.integers(128)) for k in p} for p in prompts
            ]
            batches = [
                None if t is None else r.decode(t) for r, t in zip(ranks, tokens, strict=True)
            ]
            out = runner.forward(batches)
            for r, t in enumerate(tokens):
                if t is not None:
                    want = helpers.reference_new_rows(model, ranks[r], {k: 1 for k in t})
                    chex.assert_trees_all_close(out[r], want, **TOL)
        drafts = [
            None if p is None else {k: rng.integers(0, 128, 3).tolist() for k in p} for p in prompts
        ]
        history = [
            None if p is None else {k: list(ranks[i].tokens[k]) for k in p}
            for i, p in enumerate(prompts)
        ]
        planned = [
            None if d is None else r.verify(d, tree) for r, d in zip(ranks, drafts, strict=True)
        ]
        out = runner.forward([None if p is None else p[0] for p in planned])
        for r, d in enumerate(drafts):
            if d is None:
                continue
            want = np.concatenate([
                helpers.reference_verify(model, history[r][k], d[k], planned[r][1][k], tree)
                for k in sorted(d)
            ])  # fmt: skip
            chex.assert_trees_all_close(out[r], want, **TOL)
    assert tbo.num_tbo_steps == 4 and plain.num_tbo_steps == 0


def test_bad_batch_is_rejected_before_device_work():
    _, plain, _ = _runners(8, 1, "ep")
    rank = helpers.Rank()
    batch = rank.extend({0: [1, 2, 500]})
    with pytest.raises(ValueError, match="vocabulary"):
        plain.forward([batch] + [None] * 7)
    assert plain.num_steps == 0
    with pytest.raises(ValueError, match="7 batches"):
        plain.forward([None] * 7)
    # A decode of a request whose prompt never went through the runner: its context is the
    # padding slot. Refused on every rank's behalf, before device work.
    unrecorded = split.ForwardBatch(
        forward_mode=split.ForwardMode.DECODE, batch_size=1, input_ids=[3], positions=[5],
        out_cache_loc=[9], req_pool_indices=[1], seq_lens=[6],
    )  # fmt: skip
    with pytest.raises(ValueError, match="rank 0: request row 1 writes KV positions from 5"):
        plain.forward([unrecorded] + [None] * 7)
    assert plain.num_steps == 0


def test_dropped_expert_pairs_raise_instead_of_wrong_numbers():
    config = config_lib.MoEConfig.tiny()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(8, 1), max_total_tokens=64, max_running_requests=4,
        token_buckets=(16,), dtype=jnp.float32,
        moe=layer_ops.MoEOptions(ep_capacity_factor=0.01),
    )  # fmt: skip
    batch = helpers.Rank().extend({0: list(range(16))})
    with pytest.raises(runner_lib.ExpertCapacityError, match="ep_capacity_factor=0.01"):
        runner.forward([batch] + [None] * 7)


def test_qwen3_style_model_with_tbo_matches_reference():
    config = config_lib.MoEConfig.tiny_softmax()  # softmax top-k, no shared experts
    model, plain, tbo = _runners(8, 1, "ep", config)
    rng = np.random.default_rng(11)
    ranks = [helpers.Rank() for _ in range(8)]
    new = [_prompts(rng, [6, 5]) for _ in range(8)]
    outs = [
        runner.forward([r.extend(n) for r, n in zip(ranks, new, strict=True)])
        for runner in (plain,)
    ]
    ranks_b = [helpers.Rank() for _ in range(8)]
    outs.append(tbo.forward([r.extend(n) for r, n in zip(ranks_b, new, strict=True)]))
    for r, n in enumerate(new):
        want = helpers.reference_new_rows(model, ranks[r], {k: len(v) for k, v in n.items()})
        chex.assert_trees_all_close(outs[0][r], want, **TOL)
        chex.assert_trees_all_close(outs[1][r], want, **TOL)
    assert tbo.num_tbo_steps == 1


def test_a_tbo_step_moves_its_plan_to_the_devices_in_two_buffers(monkeypatch):
    # The plan's leaves travel packed: one [dp, n] and one [m] int32 buffer; the page table
    # stays on the devices (the plan carries its writes); nothing reaches them implicitly.
    config = config_lib.MoEConfig.tiny()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(8, 1), tbo=tbo_options.TboOptions(enable_two_batch_overlap=True),
        max_total_tokens=64, max_running_requests=4, token_buckets=(16,), dtype=jnp.float32,
    )  # fmt: skip
    rng = np.random.default_rng(5)
    ranks = [helpers.Rank() for _ in range(8)]
    runner.forward([r.extend(_prompts(rng, [6, 5])) for r in ranks])  # compiles the key
    news = [{row + 2: tokens for row, tokens in _prompts(rng, [6, 5]).items()} for _ in ranks]
    put, device_put = [], jax.device_put

    def recording_put(x, *args, **kwargs):
        put.append(x)
        return device_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", recording_put)
    with jax.transfer_guard_host_to_device("disallow"):
        outs = runner.forward([r.extend(n) for r, n in zip(ranks, news, strict=True)])
    assert runner.num_tbo_steps == 2 and runner.engine.step.num_keys == 1
    assert [jax.tree.structure(x).num_leaves for x in put] == [2]  # the plan
    per_rank, replicated = put[0]
    assert per_rank.dtype == replicated.dtype == np.int32
    assert per_rank.shape[0] == 8 and replicated.ndim == 1
    for r, n in enumerate(news):
        want = helpers.reference_new_rows(model, ranks[r], {k: len(v) for k, v in n.items()})
        chex.assert_trees_all_close(outs[r], want, **TOL)


@pytest.mark.parametrize("dedup", [False, True])
def test_pallas_experts_match_xla_end_to_end(dedup):
    # moe_runner_backend="pallas" (the grouped GEMM kernel; the Pallas interpreter here, which
    # loads the dispatch's rows through their slot index) must give the logits of the default
    # capacity einsum over the materialized slots (EP over 2 devices, 4 local experts, one
    # row per (token, expert) or per (token, device); tests/models/test_experts.py covers the
    # gathered-experts path's experts_capacity).
    config = helpers.TWO_LAYER_TINY  # one MoE layer
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(3))
    dp = 2
    make = lambda impl: runner_lib.ModelRunner(  # noqa: E731
        model, mesh_lib.make_mesh(dp, 1),
        moe=layer_ops.MoEOptions(moe_a2a_backend="ep", moe_runner_backend=impl, ep_dedup=dedup),
        max_total_tokens=16, max_running_requests=2, token_buckets=(16,), dtype=jnp.float32,
    )  # fmt: skip
    new = [_prompts(np.random.default_rng(r), [7, 6]) for r in range(dp)]
    outs = [
        runner.forward([helpers.Rank().extend(n) for n in new])
        for runner in (make("xla"), make("pallas"))
    ]
    for want, got in zip(*outs, strict=True):
        chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
        assert np.abs(want).max() > 0


def test_pallas_attention_backend_matches_native_with_and_without_tbo():
    # attention_backend="pallas" (the paged kernel; the Pallas interpreter here) reaches the
    # whole batch and both TBO micro-batches: its prefill and decode logits, TBO off and on,
    # equal the native backend's without TBO. One layer keeps the three compiles short; head
    # dim 16 is the Triton kernel's minimum (the test also runs on a GPU).
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=1, head_dim=16)
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    mesh = mesh_lib.make_mesh(2, 1)
    outs = {}
    for tbo, attn in ((False, "native"), (False, "pallas"), (True, "pallas")):
        runner = runner_lib.ModelRunner(
            model, mesh, tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo),
            max_total_tokens=32, max_running_requests=4, token_buckets=(8, 16),
            dtype=jnp.float32, attention_backend=attn,
        )  # fmt: skip
        rng, ranks = np.random.default_rng(3), [helpers.Rank(), helpers.Rank()]
        prompts = [_prompts(rng, [5, 3, 6]), _prompts(rng, [4, 7])]
        steps = [runner.forward([r.extend(p) for r, p in zip(ranks, prompts, strict=True)])]
        for _ in range(2):
            tokens = [{k: int(rng.integers(128)) for k in p} for p in prompts]
            steps.append(runner.forward([r.decode(t) for r, t in zip(ranks, tokens, strict=True)]))
        outs[tbo, attn] = steps
        assert runner.num_tbo_steps == (3 if tbo else 0)
    chex.assert_trees_all_close(outs[False, "pallas"], outs[False, "native"], atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(outs[True, "pallas"], outs[False, "native"], atol=1e-5, rtol=1e-5)


def test_dedup_exchange_with_and_without_tbo_matches_reference():
    # ep_dedup (one EP row per (token, destination device)) through the whole model, plain and
    # TBO; TBO at a capacity factor that overflows (the step re-runs with the next bucket).
    config = helpers.TWO_LAYER_TINY  # one MoE layer
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    make = lambda tbo: runner_lib.ModelRunner(  # noqa: E731
        model, mesh_lib.make_mesh(4, 2), tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo),
        max_total_tokens=64, max_running_requests=4, token_buckets=(16,), dtype=jnp.float32,
        moe=layer_ops.MoEOptions(
            ep_dedup=True, ep_capacity_factor=1.5 if tbo else None, ep_overflow_policy="rerun"
        ),
    )  # fmt: skip
    rng = np.random.default_rng(17)
    new = [_prompts(rng, [6, 5]) for _ in range(4)]
    for tbo in (False, True):
        runner, ranks = make(tbo), [helpers.Rank() for _ in range(4)]
        outs = runner.forward([r.extend(n) for r, n in zip(ranks, new, strict=True)])
        assert all(d.dedup for d in runner.engine.step.dispatchers._by_rows.values())
        assert runner.engine.step.num_keys == 1 + tbo  # TBO re-ran once
        phases = runner.last_step_phases  # the host phases of both runs
        assert phases.runs == 1 + tbo and min(phases.inputs, phases.dispatch, phases.counts) > 0
        fills = np.array(runner.ep_buffer_fill())  # the re-run's: it fit
        assert fills.shape == (1 + tbo, 2) and np.all((fills > 0) & (fills <= 1)), fills
        for r, n in enumerate(new):
            want = helpers.reference_new_rows(model, ranks[r], {k: len(v) for k, v in n.items()})
            chex.assert_trees_all_close(outs[r], want, **TOL)
    assert runner.num_tbo_steps == 1


@pytest.mark.parametrize(
    "plain_exchange, tbo_exchange", [("peer_copy", None), ("dense", "peer_copy")]
)
def test_peer_copy_exchange_with_and_without_tbo_matches_reference(plain_exchange, tbo_exchange):
    # The EP exchange by peer copies (jtbo.collectives.peer_copy; memcpy between the CPU
    # devices' buffers here) through the whole model, plain and TBO, against the unsharded
    # model; or XLA's all-to-all in plain steps and the peer copy in TBO steps.
    config = helpers.TWO_LAYER_TINY  # one MoE layer
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    moe = layer_ops.MoEOptions(ep_exchange=plain_exchange, ep_exchange_tbo=tbo_exchange)
    make = lambda tbo: runner_lib.ModelRunner(  # noqa: E731
        model, mesh_lib.make_mesh(4, 2), tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo),
        max_total_tokens=64, max_running_requests=4, token_buckets=(16,), dtype=jnp.float32,
        moe=moe,
    )  # fmt: skip
    rng = np.random.default_rng(23)
    new = [_prompts(rng, [5, 6]) for _ in range(4)]
    for tbo in (False, True):
        runner, ranks = make(tbo), [helpers.Rank() for _ in range(4)]
        outs = runner.forward([r.extend(n) for r, n in zip(ranks, new, strict=True)])
        assert runner.num_tbo_steps == tbo
        (exchange,) = {d.exchange for d in runner.engine.step.dispatchers._by_rows.values()}
        assert (
            exchange
            == moe.exchange(tbo)
            == (tbo_exchange if tbo and tbo_exchange else plain_exchange)
        )
        for r, n in enumerate(new):
            want = helpers.reference_new_rows(model, ranks[r], {k: len(v) for k, v in n.items()})
            chex.assert_trees_all_close(outs[r], want, **TOL)


def test_routing_stats_round_trip_sizes_the_next_runners_capacities(tmp_path):
    # A runner records its steps' EP peak loads; a second runner given the saved file sizes
    # those dispatch sizes at headroom x peaks (below the factor rule here) and still matches
    # the unsharded model. A file of another EP layout is refused.
    config = helpers.TWO_LAYER_TINY  # one MoE layer
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    moe = layer_ops.MoEOptions(ep_capacity_factor=4.0, ep_overflow_policy="rerun")
    make = lambda mesh, **kw: runner_lib.ModelRunner(  # noqa: E731
        model, mesh, moe=moe, max_total_tokens=64, max_running_requests=4, token_buckets=(16,),
        dtype=jnp.float32, **kw,
    )  # fmt: skip
    rng = np.random.default_rng(29)
    new = [_prompts(rng, [6, 7]) for _ in range(4)]
    first = make(mesh_lib.make_mesh(4, 2))
    first.forward([helpers.Rank().extend(n) for n in new])
    stats = first.ep_routing_stats()
    assert list(stats) == [8] and all(peak > 0 for peak in stats[8])  # 16 rows / attn_tp 2
    path = tmp_path / "routing.json"
    first.save_ep_routing_stats(path)
    second, ranks = (
        make(mesh_lib.make_mesh(4, 2), ep_routing_stats=path),
        [helpers.Rank() for _ in range(4)],
    )
    sized = second.engine.step.dispatchers.dispatcher(8)
    factor_rule = first.engine.step.dispatchers.dispatcher(8)
    assert sized.peer_capacity == min(math.ceil(1.25 * stats[8][0]), sized.worst_peer_capacity)
    assert sized.expert_capacity == math.ceil(1.25 * stats[8][1]) < factor_rule.expert_capacity
    outs = second.forward([r.extend(n) for r, n in zip(ranks, new, strict=True)])
    for r, n in enumerate(new):
        want = helpers.reference_new_rows(model, ranks[r], {k: len(v) for k, v in n.items()})
        chex.assert_trees_all_close(outs[r], want, **TOL)
    with pytest.raises(ValueError, match="'model'"):
        make(mesh_lib.make_mesh(2, 2, devices=jax.devices()[:4]), ep_routing_stats=path)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU's ragged refusal")
def test_every_ep_option_reaches_the_step():
    # ep_exchange and ep_slot_alignment are settable on the runner (and in its fingerprint);
    # the ragged exchange, GPU-only, is refused with a clear error before any compile.
    model = model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(0))
    make = lambda **kw: runner_lib.ModelRunner(  # noqa: E731
        model, mesh_lib.make_mesh(8, 1), max_total_tokens=64, max_running_requests=4,
        dtype=jnp.float32, moe=layer_ops.MoEOptions(**kw),
    )  # fmt: skip
    aligned = make(ep_slot_alignment=8)
    assert (
        aligned.parallel.moe.ep_slot_alignment == 8 and aligned.parallel.moe.ep_exchange == "dense"
    )
    ragged = make(ep_exchange="ragged")
    assert ragged.parallel.moe.ep_exchange == "ragged"
    with pytest.raises(ValueError, match="exchange='ragged' needs a GPU"):
        ragged.forward([helpers.Rank().extend({0: [1, 2, 3]})] + [None] * 7)


def _dp_contexts(runner):
    """Per compile key of the runner's step, its DP contexts (whole step, or TBO children)."""
    found = []
    for key in runner.engine.step._jitted:
        layout = key.layouts[1]  # the replicated buffer: the DP contexts
        replicated = jax.tree.unflatten(layout.treedef, [np.zeros(s) for s in layout.shapes])
        found.append(replicated.child_dp_contexts or (replicated.dp_context,))
    return found


def test_skewed_ranks_sum_len_equals_max_len_and_reference():
    # Ranks of 14, 3, 1 and 0 tokens through the DP gather of the "none" backend (4 x 2
    # devices): SUM_LEN gathers a 20-row bucket of the 18 tokens where MAX_LEN gathers 4 x 16,
    # TBO off and on; "auto" picks SUM_LEN for them. Logits equal MAX_LEN's and the reference.
    config = helpers.TWO_LAYER_TINY  # one MoE layer
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(2))
    mesh = mesh_lib.make_mesh(4, 2)
    make = lambda padding, tbo: runner_lib.ModelRunner(  # noqa: E731
        model, mesh, tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo),
        moe=layer_ops.MoEOptions(moe_a2a_backend="none"), max_total_tokens=32,
        max_running_requests=4, token_buckets=(8, 16), dtype=jnp.float32, dp_padding=padding,
    )  # fmt: skip
    new = [_prompts(np.random.default_rng(r), n) for r, n in enumerate([[9, 5], [3], [1]])]
    outs = {}
    for padding, tbo in (("max_len", False), ("sum_len", False), ("max_len", True), ("auto", True)):
        runner, ranks = make(padding, tbo), [helpers.Rank() for _ in range(3)]
        batches = [r.extend(n) for r, n in zip(ranks, new, strict=True)] + [None]
        outs[padding, tbo] = runner.forward(batches)
        assert runner.num_tbo_steps == tbo
        for r, n in enumerate(new):
            want = helpers.reference_new_rows(model, ranks[r], {k: len(v) for k, v in n.items()})
            chex.assert_trees_all_close(outs[padding, tbo][r], want, **TOL)
        (contexts,) = _dp_contexts(runner)
        want_mode = "MAX_LEN" if padding == "max_len" else "SUM_LEN"
        assert {c.padding_mode.name for c in contexts} == {want_mode}
        if not tbo:
            assert contexts[0].global_buffer_len == (64 if padding == "max_len" else 20)
    for key in (("sum_len", False), ("max_len", True), ("auto", True)):
        chex.assert_trees_all_close(outs[key][:3], outs["max_len", False][:3], atol=1e-5, rtol=1e-5)


def test_sum_len_steps_compile_once_per_buffer_bucket():
    # SUM_LEN lengths are buckets of the token sum: every step of one (capacity, length)
    # bucket runs one program (the step's trace guard fails a retrace); a sum in the next
    # bucket compiles one more.
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=1)
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(4, 2), moe=layer_ops.MoEOptions(moe_a2a_backend="none"),
        max_total_tokens=32, max_running_requests=4, token_buckets=(16,), dtype=jnp.float32,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for lens in ([[14], [3], [1], None], [[9, 4], [2, 2], [1], [1]], [[8], [8], [1], [2]]):
        batches = [None if n is None else helpers.Rank().extend(_prompts(rng, n)) for n in lens]
        runner.forward(batches)  # sums 18, 19, 19: bucket 20
    assert runner.engine.step.num_keys == 1 and runner.compile_count == 1
    runner.forward([helpers.Rank().extend(_prompts(rng, [n])) for n in (16, 4, 1, 1)])  # 22
    assert runner.engine.step.num_keys == 2 and runner.compile_count == 2
    lengths = sorted(contexts[0].global_buffer_len for contexts in _dp_contexts(runner))
    assert lengths == [20, 24]


def _non_default(options) -> None:
    """Fails unless every field of ``options`` differs from its default (so the test below
    covers a field added later only once it sets it)."""
    for field in dataclasses.fields(options):
        if field.name not in _MODEL_SOURCE_FIELDS:  # set by the test that follows
            assert getattr(options, field.name) != field.default, field.name


# The step-model source of "auto" takes no timer of its own, so the options above (which set
# one) leave these at their defaults; test_the_tbo_auto_source_changes_the_fingerprint sets them.
_MODEL_SOURCE_FIELDS = ("tbo_auto_source", "tbo_predictor")


def _every_option_set(tmp_path) -> tuple[layer_ops.MoEOptions, tbo_options.TboOptions, dict]:
    """Non-default values of every field of the runner's config objects, and its keywords."""
    plan = tmp_path / "plan.json"
    tbo_plan_file.save(plan, [])
    moe = layer_ops.MoEOptions(
        moe_a2a_backend="none", moe_runner_backend="pallas", ep_capacity_factor=2.0,
        ep_overflow_policy="rerun", ep_exchange="peer_copy", ep_dedup=False, ep_slot_alignment=8,
        ep_capacity_headroom=1.5, ep_exchange_tbo="dense", moe_runner_backend_tbo="xla",
    )  # fmt: skip
    tbo = tbo_options.TboOptions(
        enable_two_batch_overlap="auto", tbo_token_distribution_threshold=0.3,
        tbo_round_barriers=True, tbo_issue_barriers=False, tbo_auto_trials=2,
        tbo_auto_margin=0.1, tbo_timer=lambda shape, use_tbo, run: 1.0, tbo_plan=plan,
        tbo_child_buckets=3,
    )  # fmt: skip
    kwargs = dict(
        max_total_tokens=32, max_running_requests=3, token_buckets=(8, 16),
        attention_backend="pallas", query_tile=16, dp_padding="sum_len",
    )  # fmt: skip
    return moe, tbo, kwargs


def test_every_parallel_and_plan_option_is_settable_through_the_runner(tmp_path):
    # Each field of the layers' ParallelConfig and of the planner's PlanOptions is set from the
    # runner's config objects and keywords, or read off the mesh; nothing else decides them.
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=1)
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    moe, tbo, kwargs = _every_option_set(tmp_path)
    _non_default(moe)
    _non_default(tbo)
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(2, 2), moe=moe, tbo=tbo, dtype=jnp.float32, **kwargs
    )
    parallel = {
        f.name: getattr(runner.parallel, f.name) for f in dataclasses.fields(runner.parallel)
    }
    assert parallel == dict(
        attn_tp_size=2, moe=moe, attention_backend="pallas", tbo_round_barriers=True,
        tbo_issue_barriers=False,
    )  # fmt: skip
    plan = {f.name: getattr(runner.options, f.name) for f in dataclasses.fields(runner.options)}
    assert plan == dict(
        attn_tp_size=2, token_buckets=(8, 16), seq_capacity=3, max_context=32, enable_tbo=True,
        threshold=0.3, query_tile=16, attention_backend="pallas", dp_padding="sum_len",
        child_buckets=3,
    )  # fmt: skip
    auto = runner.plans.auto
    assert (auto.trials, auto.margin, auto.timer) == (2, 0.1, tbo.tbo_timer)
    assert runner.runner_config.tbo_switch == "auto" and runner.runner_config.auto
    assert runner.runner_config.tbo_auto.known == ()  # the plan file holds no decision


def test_the_fingerprint_covers_every_option_processes_must_share(tmp_path):
    # Processes refuse to serve together unless their runners were built alike: every MoE and
    # TBO option (but the timer and the plan file's path) and the numerics guard change the
    # fingerprint that the step exchange compares.
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=1)
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    mesh = mesh_lib.make_mesh(2, 1)

    def fingerprint(moe=None, tbo=None, check=True) -> int:
        return runner_lib.ModelRunner(
            model, mesh, moe=moe, tbo=tbo, max_total_tokens=16, max_running_requests=2,
            dtype=jnp.float32, check_finite_logits=check,
        ).agreement.fingerprint  # fmt: skip

    base = fingerprint()
    moe, tbo, _ = _every_option_set(tmp_path)
    changed = [fingerprint(check=False)]
    # The TBO steps' experts and exchange resolve to the plain steps' (here "xla" and "dense")
    # when None: naming those is the same set-up, so other values are the changes.
    resolved = {"moe_runner_backend_tbo": "pallas", "ep_exchange_tbo": "peer_copy"}
    for field in dataclasses.fields(moe):
        value = resolved.get(field.name, getattr(moe, field.name))
        changed.append(fingerprint(moe=layer_ops.MoEOptions(**{field.name: value})))
    same = layer_ops.MoEOptions(moe_runner_backend_tbo="xla", ep_exchange_tbo="dense")
    assert fingerprint(moe=same) == base
    for field in dataclasses.fields(tbo):
        if field.name not in ("tbo_timer", "tbo_plan", *_MODEL_SOURCE_FIELDS):
            value = getattr(tbo, field.name)
            changed.append(fingerprint(tbo=tbo_options.TboOptions(**{field.name: value})))
    assert base not in changed, changed
    assert fingerprint() == base


def test_the_tbo_auto_source_changes_the_fingerprint():
    # Processes that decide "auto" shapes differently (timed against from the step model)
    # must not serve together; the predictor itself, a function, is left out like the timer.
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=1)
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))

    def fingerprint(**tbo) -> int:
        return runner_lib.ModelRunner(
            model, mesh_lib.make_mesh(2, 1), max_total_tokens=16, max_running_requests=2,
            dtype=jnp.float32,
            tbo=tbo_options.TboOptions(enable_two_batch_overlap="auto", **tbo),
        ).agreement.fingerprint  # fmt: skip

    def predictor(shape):
        return 1.0, 2.0

    timed = fingerprint()
    modelled = fingerprint(tbo_auto_source="model", tbo_predictor=predictor)
    assert modelled != timed
    assert fingerprint(tbo_auto_source="model", tbo_predictor=lambda shape: (3.0, 1.0)) == modelled


def test_query_tile_reaches_the_extend_steps_attention():
    # query_tile sizes the attention tiles of extend steps (planning.PlanOptions): 4-row tiles
    # give the reference's logits, and the step's metadata carries them.
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=1)
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(4))
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(1, 1), max_total_tokens=32, max_running_requests=2,
        token_buckets=(16,), dtype=jnp.float32, query_tile=4,
    )  # fmt: skip
    rank = helpers.Rank()
    new = _prompts(np.random.default_rng(9), [6, 5])
    batch = rank.extend(new)
    plan = planning.plan_step([batch], runner.options)
    assert plan.per_rank.attn_metadata.capacity.query_tile == 4
    (got,) = runner.forward([batch])
    want = helpers.reference_new_rows(model, rank, {k: len(v) for k, v in new.items()})
    chex.assert_trees_all_close(got, want, **TOL)


def test_params_from_shares_one_copy_of_the_device_parameters():
    # A second runner of the same model, mesh, dtype and backend reads the first one's
    # parameters (the very same device arrays) and computes the same logits; anything that
    # would lay them out or value them differently is refused.
    config = helpers.TWO_LAYER_TINY
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    make = lambda **kw: runner_lib.ModelRunner(  # noqa: E731
        model, mesh_lib.make_mesh(4, 2), max_total_tokens=64, max_running_requests=4,
        token_buckets=(16,), **{"dtype": jnp.float32, **kw},
    )  # fmt: skip
    first = make()
    second = make(tbo=tbo_options.TboOptions(enable_two_batch_overlap=True), params_from=first)
    pairs = zip(
        jax.tree.leaves(first.engine.params), jax.tree.leaves(second.engine.params), strict=True
    )
    assert all(a is b for a, b in pairs)
    rng = np.random.default_rng(31)
    new = [_prompts(rng, [5, 6]) for _ in range(4)]
    outs = [r.forward([helpers.Rank().extend(n) for n in new]) for r in (first, second)]
    assert second.num_tbo_steps == 1
    for got, want in zip(outs[1], outs[0], strict=True):
        chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="dtype"):
        make(dtype=jnp.bfloat16, params_from=first)
    with pytest.raises(ValueError, match="moe_a2a_backend"):
        make(moe=layer_ops.MoEOptions(moe_a2a_backend="none"), params_from=first)
    other = model_lib.MoEModel(config, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="another model object"):
        runner_lib.ModelRunner(
            other, mesh_lib.make_mesh(4, 2), max_total_tokens=64, max_running_requests=4,
            token_buckets=(16,), dtype=jnp.float32, params_from=first,
        )  # fmt: skip


def test_warmup_compiles_the_extend_programs_of_the_sequence_buckets_served():
    # Extend attention is sized by the step's sequence bucket (planning.seq_bucket): a batch
    # of 20 prompts needs the 32-sequence program, which warmup(seq_counts=...) compiles.
    config = helpers.TWO_LAYER_TINY  # one MoE layer
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    make = lambda: runner_lib.ModelRunner(  # noqa: E731
        model, mesh_lib.make_mesh(8, 1), max_total_tokens=128, max_running_requests=32,
        token_buckets=(32,), dtype=jnp.float32,
    )  # fmt: skip
    few = helpers.Rank().extend({row: [row + 1, row + 2] for row in range(3)})
    many = helpers.Rank().extend({row: [row + 1] for row in range(20)})
    for seq_counts, compiles_on_serving in (((1,), 1), ((1, 20), 0)):
        runner = make()
        warm = runner.warmup([32], [split.ForwardMode.EXTEND], seq_counts=seq_counts)
        assert warm == len(seq_counts)
        runner.forward([few] + [None] * 7)  # the 16-sequence bucket: warmed by one prompt
        assert runner.compile_count == warm
        runner.forward([many] + [None] * 7)
        assert runner.compile_count == warm + compiles_on_serving
    with pytest.raises(ValueError, match=r"seq_counts \[33\] outside \[1, max_running_requests"):
        runner.warmup([32], [split.ForwardMode.EXTEND], seq_counts=(1, 33))


def test_warmup_compiles_every_child_capacity_of_a_tbo_bucket():
    # Bucket 64 has child capacities 32 (an even split) and 33 (the bound): warm-up compiles
    # both, an even and an uneven step then compile nothing, and the runner counts the
    # two TBO steps.
    config = helpers.TWO_LAYER_TINY  # one MoE layer
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(8, 1), tbo=tbo_options.TboOptions(enable_two_batch_overlap=True),
        max_total_tokens=160, max_running_requests=4, token_buckets=(64,), dtype=jnp.float32,
    )  # fmt: skip
    assert runner.warmup([64], [split.ForwardMode.EXTEND]) == 2
    rng = np.random.default_rng(8)
    for lens in ([20, 20], [33, 31]):  # splits 20 / 20 and 33 / 31
        runner.forward([helpers.Rank().extend(_prompts(rng, lens))] + [None] * 7)
    assert runner.compile_count == 2 and runner.num_tbo_steps == 2 + 2


@pytest.mark.parametrize("tbo", [False, True])
def test_last_logits_are_each_sequence_last_row_of_all_logits(tbo):
    # forward(logits="last") runs the LM head on each sequence's last row only; an identical
    # runner's forward(logits="all") must hold the same values at those rows: an extend step
    # with an idle rank (rows 5 and 9 of rank 0), then a decode step.
    config = helpers.TWO_LAYER_TINY  # one MoE layer
    runners = [_runners(2, 1, "ep", config)[2 if tbo else 1] for _ in range(2)]
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, [6, 4])
    ranks = [[helpers.Rank(), helpers.Rank()] for _ in runners]
    steps = [
        lambda rank_pair: [rank_pair[0].extend(prompts), None],
        lambda rank_pair: [rank_pair[0].decode({0: 3, 1: 7}), rank_pair[1].extend({0: [1, 2]})],
    ]
    want_rows = [[[5, 9], None], [[0, 1], [1]]]
    for step, rows in zip(steps, want_rows, strict=True):
        full = runners[0].forward(step(ranks[0]))
        last = runners[1].forward(step(ranks[1]), logits="last")
        for got, every, picked in zip(last, full, rows, strict=True):
            if picked is None:
                assert got is None and every is None
                continue
            chex.assert_trees_all_close(got, every[picked], atol=1e-6, rtol=1e-6)
            assert np.abs(got).max() > 0
    with pytest.raises(ValueError, match="logits must be one of"):
        runners[1].forward([None, None], logits="first")
