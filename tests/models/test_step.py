"""Parameter specs, layouts, strategy layouts, overlap coverage, packed inputs, trace guard."""

import dataclasses
import re
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jtbo import aot
from jtbo.analysis import aot_report, hlo_schedule, report, schedule_costs
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.collectives import mesh as mesh_lib
from jtbo.kernels import fp8_blocks
from jtbo.models import config as config_lib
from jtbo.models import layer_ops, step
from jtbo.models import model as model_lib
from jtbo.overlap import operations, strategy
from jtbo.runner import planning
from jtbo.runner import runner as runner_lib
from jtbo.split import ForwardMode, packing
from tests.runner import helpers


@pytest.mark.parametrize("backend", ["ep", "none"])
def test_param_specs(backend):
    model = model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(0))
    _, params = nnx.split(model)
    specs = step.param_specs(params, backend)
    moe = specs["layers"][1]["moe"]
    tp_axes = mesh_lib.TP_AXES
    want = P(tp_axes, None, None, None) if backend == "ep" else P(None, None, None, tp_axes)
    assert moe["experts"]["w_gate_up"].get_value() == want
    assert moe["shared"]["w_gate_up"].get_value() == P()  # the shared MLP is replicated
    assert specs["layers"][0]["attn"]["wqkv"].get_value() == P(None, "attn_tp", None, None)
    assert specs["layers"][0]["attn"]["wo"].get_value() == P("attn_tp", None, None)
    assert specs["embed"]["table"].get_value() == P()


@pytest.mark.parametrize("backend", ["ep", "none"])
def test_fp8_expert_specs_are_the_float_ones_in_the_stored_order(backend):
    # FP8 experts are stored contraction-last (fp8_blocks.expert_axes): each spec is the
    # float layout's permuted alike, the block scales' that of their values.
    config = config_lib.MoEConfig.tiny()
    fp8 = dataclasses.replace(config, expert_dtype="float8_e4m3fn", expert_block_size=(16, 16))
    specs = {}
    for name, cfg in (("float", config), ("fp8", fp8)):
        _, state = nnx.split(
            nnx.eval_shape(lambda cfg=cfg: model_lib.MoEModel(cfg, rngs=nnx.Rngs(0)))
        )
        specs[name] = step.param_specs(state, backend)["layers"][1]["moe"]["experts"]
    float_specs, fp8_specs = (
        {key: v.get_value() for key, v in specs[name].items()} for name in ("float", "fp8")
    )
    assert sorted(float_specs) == ["w_down", "w_gate_up"]
    split = mesh_lib.TP_AXES
    want_float = dict(
        ep=dict(w_gate_up=P(split, None, None, None), w_down=P(split, None, None)),
        none=dict(w_gate_up=P(None, None, None, split), w_down=P(None, split, None)),
    )[backend]
    assert float_specs == want_float
    for name, spec in want_float.items():
        axes = fp8_blocks.expert_axes(len(spec))
        stored = P(*(spec[axis] for axis in axes))
        assert fp8_specs[name] == fp8_specs[name + "_scale"] == stored, name
    if backend == "none":  # F is stored axis 2 of both
        assert fp8_specs["w_gate_up"] == P(None, None, split, None)
        assert fp8_specs["w_down"] == P(None, None, split)


@pytest.mark.parametrize("backend", ["ep", "none"])
def test_split_params_are_plain_dicts_with_the_state_values_and_specs(backend):
    model = model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(3))
    graphdef, params = step.split_params(model)
    _, state = nnx.split(model)

    def nodes(tree):  # every inner node: jit flattens plain dicts without calling Python
        assert isinstance(tree, dict), type(tree)
        for child in tree.values():
            if not isinstance(child, jax.Array):
                nodes(child)

    nodes(params)
    leaves, state_leaves = jax.tree.leaves(params), jax.tree.leaves(state)
    assert len(leaves) == len(state_leaves) > 0
    for got, want in zip(leaves, state_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    merged = jax.tree.leaves(nnx.split(nnx.merge(graphdef, params))[1])
    for got, want in zip(merged, state_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The specs of the plain dicts are the specs of the state, spec for spec.
    plain = jax.tree.leaves(step.param_specs(params, backend), is_leaf=lambda x: isinstance(x, P))
    of_state = [
        v.get_value() for v in jax.tree.leaves(
            step.param_specs(state, backend), is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    ]  # fmt: skip
    assert plain == of_state and all(isinstance(spec, P) for spec in plain)


@pytest.mark.parametrize("factory", [config_lib.MoEConfig.tiny, config_lib.MoEConfig.tiny_softmax])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_operations_fill_the_strategy_layout(factory, mode):
    config = factory()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    parallel = layer_ops.ParallelConfig.for_mesh(
        mesh_lib.make_mesh(8, 1), moe=layer_ops.MoEOptions(moe_runner_backend="xla")
    )
    ops = [layer_ops.moe_layer_operations(layer, config, parallel) for layer in model.layers[1:]]
    family = strategy.LayerFamily.DEEPSEEK if config.num_shared_experts else (
        strategy.LayerFamily.QWEN3_MOE
    )  # fmt: skip
    built = strategy.OperationsStrategy.init_new_tbo(ops, mode, family)
    names = [op.debug_name for op in built.operations if hasattr(op, "debug_name")]
    assert names[0] == "L0.comm_prepare_attn" and names[-1] == "L1.comm_postprocess_layer"
    assert ("L0.shared_experts" in names) == bool(config.num_shared_experts)


def test_moe_options_reject_bad_values():
    with pytest.raises(ValueError, match="moe_runner_backend"):
        layer_ops.MoEOptions(moe_runner_backend="triton")
    with pytest.raises(ValueError, match="moe_a2a_backend"):
        layer_ops.MoEOptions(moe_a2a_backend="deepep")
    with pytest.raises(ValueError, match="ep_capacity_factor"):
        layer_ops.MoEOptions(ep_capacity_factor=0.0)
    with pytest.raises(ValueError, match="ep_overflow_policy"):
        layer_ops.MoEOptions(ep_overflow_policy="drop")
    with pytest.raises(ValueError, match="ep_exchange"):
        layer_ops.MoEOptions(ep_exchange="sparse")
    with pytest.raises(ValueError, match="ep_slot_alignment"):
        layer_ops.MoEOptions(ep_slot_alignment=0)


def test_parallel_config_reads_the_mesh_and_needs_resolved_backends():
    moe = layer_ops.MoEOptions(moe_runner_backend="pallas")
    assert layer_ops.ParallelConfig.for_mesh(mesh_lib.make_mesh(4, 2), moe=moe).attn_tp_size == 2
    with pytest.raises(ValueError, match="moe_runner_backend"):
        layer_ops.ParallelConfig.for_mesh(mesh_lib.make_mesh(8, 1), moe=layer_ops.MoEOptions())
    bad_axes = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    with pytest.raises(ValueError, match="mesh axes"):
        layer_ops.ParallelConfig.for_mesh(bad_axes, moe=moe)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_tbo_step_covers_its_collectives_on_an_h200_compile(mode):
    # The coverage target (>= 0.95 of collective bytes under the other micro-batch's compute)
    # for the model's own step; every collective counts, the overflow psum included.
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    rep = aot_report.model_overlap_report(
        helpers.TWO_LAYER_TINY, dp_size=4, attn_tp_size=2, mode=mode, tokens_per_rank=16
    )  # one dense and one MoE layer: every kind of collective the step has
    assert rep.coverage >= 0.95, report.format_report(rep)
    assert all(window.micro_batch for window in rep.windows if window.num_bytes > 16)
    # Only the 16-byte overflow / peak-load reductions may run synchronously: a larger one
    # turning synchronous means something joined the two micro-batches (step.py's input
    # barrier, for one) or pinned them too tightly (issue barriers with attn_tp > 1, which
    # ParallelConfig leaves off by default).
    assert all(window.is_async for window in rep.windows if window.num_bytes > 16)


def test_step_key_traces_once_and_a_retrace_fails_loudly():
    config = helpers.TWO_LAYER_TINY  # the key and its guard do not depend on the depth
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    runner = runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(8, 1), max_total_tokens=32, max_running_requests=2,
        token_buckets=(8,), dtype=jnp.float32,
    )  # fmt: skip
    batches = [helpers.Rank().extend({0: [3, 4, 5]})] + [None] * 7
    runner.forward(batches)
    runner.forward([helpers.Rank().extend({1: [6, 7]})] + [None] * 7)
    assert runner.engine.step.num_keys == 1  # and the guard let the second step through
    plan = planning.plan_step([b or planning.idle_batch() for b in batches], runner.options)
    built = runner.engine.step
    dispatchers = built.dispatchers.for_step(plan.capacity, plan.child_capacity)
    inputs = step.pack_step_inputs(plan.per_rank, plan.replicated)
    key = built.key(inputs, mode=int(plan.mode), child_capacity=None, dispatchers=dispatchers)
    assert key in built._jitted  # the runner's steps had this key
    # Float positions are another layout, hence another key (compiled once on its own)...
    floats = dataclasses.replace(
        plan.per_rank, positions=plan.per_rank.positions.astype(np.float32)
    )
    float_key = built.key(
        step.pack_step_inputs(floats, plan.replicated), mode=int(plan.mode),
        child_capacity=None, dispatchers=dispatchers,
    )  # fmt: skip
    assert float_key != key and float_key.layouts[0].dtypes != key.layouts[0].dtypes
    # ...but buffers the key does not describe (the same words as float32): jit would
    # silently retrace; the guard refuses.
    engine = runner.engine
    cache = kv_cache_lib.KVCache(k=engine.k, v=engine.v, req_to_token=engine.req_to_token)
    with pytest.raises(AssertionError, match="traced > 1 times"):
        built.jitted(key)(
            runner.engine.params, cache, inputs.per_rank.view(np.float32), inputs.replicated
        )


def test_pack_step_inputs_packs_a_tbo_plan_into_two_buffers():
    options = planning.PlanOptions(
        attn_tp_size=1, token_buckets=(16,), seq_capacity=4, max_context=64, enable_tbo=True,
        threshold=0.48,
    )  # fmt: skip
    batch = helpers.Rank().extend({0: [3, 4, 5, 6, 7, 8], 1: [1, 2, 3, 4, 5, 6]})
    plan = planning.plan_step([batch, batch], options)
    assert plan.child_capacity is not None
    inputs = step.pack_step_inputs(plan.per_rank, plan.replicated)
    per_rank_layout, replicated_layout = inputs.layouts
    # ids, positions, num_tokens, page writes, split index and 7 metadata arrays per child: no
    # whole-batch metadata, which a TBO step never reads.
    assert plan.per_rank.attn_metadata is None
    assert (per_rank_layout.treedef.num_leaves, replicated_layout.treedef.num_leaves) == (19, 3)
    assert inputs.per_rank.shape == (2, per_rank_layout.width) and inputs.capacity == 16
    assert inputs.replicated.shape == (replicated_layout.width,)
    chex.assert_trees_all_equal(packing.unpack(inputs.per_rank, per_rank_layout), plan.per_rank)
    chex.assert_trees_all_equal(
        packing.unpack(inputs.replicated, replicated_layout), plan.replicated
    )
    wide = dataclasses.replace(plan.per_rank, positions=plan.per_rank.positions.astype(np.int64))
    with pytest.raises(ValueError, match=r"\.positions of dtype int64"):
        step.pack_step_inputs(wide, plan.replicated)


def _pool_copies(hlo_text: str, pool_shape: str) -> int:
    """Instructions of the entry computation that copy a whole KV pool."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    return len(re.findall(rf"= {re.escape(pool_shape)}\{{[0-9,]+\}} copy\(", entry))


def _weight_operand(hlo_text: str, weight: str) -> tuple[str, str]:
    """The entry computation, and a regex alternation of parameter ``weight``'s names there:
    the parameter and its bitcasts."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    names = [re.search(rf"%({re.escape(weight)}[\w.]*) = \S+ parameter\(", entry).group(1)]
    names += re.findall(rf"%([\w.]+) = \S+ bitcast\(%{re.escape(names[0])}\)", entry)
    return entry, "|".join(re.escape(name) for name in names)


def _weight_reads(hlo_text: str, weight: str, kinds: str = "fusion|custom-call") -> int:
    """Instructions of the entry computation, of the ``kinds`` (an alternation), that take
    parameter ``weight`` (or a bitcast of it): kernels by default; ``tuple`` counts the loops
    (the Pallas grouped GEMM's launches run in one) that read it."""
    entry, operand = _weight_operand(hlo_text, weight)
    return len(re.findall(rf"(?:{kinds})\([^)]*%(?:{operand})[,)]", entry))


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_one_h200_tbo_step_keeps_the_pool_in_place_and_reads_each_weight_once(mode):
    # The one-H200 speed target (TBO / plain <= 1.05) at compile level. Before the
    # fixes the TBO program copied the KV pool (XLA could not order the other micro-batch's
    # pool write after this attention's reads) and read every weight once per micro-batch.
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    # One dense and one MoE layer: every weight checked below (layer 0's attention and MLP,
    # layer 1's shared and routed experts) and two layers' attentions sharing the pool.
    config = helpers.TWO_LAYER_TINY
    mesh = aot_report.h200_mesh(1, 1)
    compiled = {}
    for tbo in (False, True):
        jitted, args, options = aot_report.model_step_program(
            config,
            mesh,
            mode=mode,
            tokens_per_rank=64,
            enable_tbo=tbo,
            moe=layer_ops.MoEOptions(ep_capacity_factor=2.0),
        )
        compiled[tbo] = jitted.lower(*args).compile(compiler_options=options)
    pool = args[1].k.shape[1:]  # [layers, slots, kv_heads, head_dim] of the one DP rank
    pool_shape = f"bf16[{','.join(map(str, pool))}]"
    text = {tbo: c.as_text() for tbo, c in compiled.items()}
    assert _pool_copies(text[True], pool_shape) == 0
    # Each weight is read by one kernel with or without TBO: the fused Q/K/V and gate/up
    # weights leave XLA's dot merger one pair to join, A's and B's matmul.
    for weight in (
        "params__layers___0___attn____wqkv",
        "params__layers___0___mlp____w_gate_up",
        "params__layers___1___moe____shared____w_gate_up",
        "params__layers___1___moe____experts____w_gate_up",
    ):
        assert _weight_reads(text[True], weight) == _weight_reads(text[False], weight) == 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compiles for an H200 on the CPU")
def test_mla_decode_step_reads_the_output_projection_in_place_on_an_h200():
    # The absorbed attention's output came out value-major, and XLA copied the whole output
    # projection into that order on every decode step (a loop fusion reading the weight);
    # only matmul kernels may read it.
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    config = config_lib.MoEConfig.tiny_mla()
    jitted, args, options = aot_report.model_step_program(
        config, aot_report.h200_mesh(1, 1), mode=ForwardMode.DECODE, tokens_per_rank=16,
        enable_tbo=False,
    )  # fmt: skip
    text = jitted.lower(*args).compile(compiler_options=options).as_text()
    for layer in range(config.num_layers):
        readers = _weight_readers(text, f"params__layers___{layer}___attn____wo")
        assert readers and all("kind=kCustom" in r or " custom-call(" in r for r in readers)


def _weight_readers(hlo_text: str, weight: str) -> list[str]:
    """The entry computation's instructions that read parameter ``weight`` (directly or
    through bitcasts), bitcasts left out."""
    entry, operand = _weight_operand(hlo_text, weight)
    return [
        line for line in entry.splitlines()
        if re.search(rf"\([^)]*%(?:{operand})[,)]", line) and " bitcast(" not in line
    ]  # fmt: skip


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compiles for an H200 on the CPU")
def test_one_h200_tbo_step_runs_one_grouped_gemm_per_layer_for_both_micro_batches():
    # The lockstep executor's joint experts: a one-device TBO prefill with the Pallas grouped
    # GEMM (micro-batches past the dot merger's rows) compiles to as many grouped GEMM
    # kernels as the plain step, not two per layer.
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    moe = layer_ops.MoEOptions(ep_capacity_factor=4.0, moe_runner_backend="pallas")
    config = helpers.TWO_LAYER_TINY  # one MoE layer: its two grouped GEMMs
    reads = {}
    for tbo in (False, True):
        jitted, args, options = aot_report.model_step_program(
            config, aot_report.h200_mesh(1, 1), mode=ForwardMode.EXTEND,
            tokens_per_rank=2 * step.SINGLE_DEVICE_MERGE_MAX_ROWS + 64, enable_tbo=tbo,
            moe=moe,
        )  # fmt: skip
        text = jitted.lower(*args).compile(compiler_options=options).as_text()
        reads[tbo] = [
            _weight_reads(text, f"params__layers___{layer}___moe____experts____w_{name}", "tuple")
            for layer, moe_layer in enumerate(config.is_moe_layer) if moe_layer
            for name in ("gate_up", "down")
        ]  # fmt: skip
    assert reads[True] == reads[False] == [1] * len(reads[False]), reads


def test_step_compiler_options_keep_micro_batches_apart_only_with_communication():
    if jax.default_backend() == "cpu":  # a GPU mesh always records CUDA graphs
        assert step.step_compiler_options(mesh_lib.make_mesh(1, 1), 8) is None
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    one, many = aot_report.h200_mesh(1, 1), aot_report.h200_mesh(4, 2)
    graphs = {"xla_gpu_enable_command_buffer": step.GPU_COMMAND_BUFFER}
    assert step.step_compiler_options(one, None) == graphs
    small = step.step_compiler_options(one, step.SINGLE_DEVICE_MERGE_MAX_ROWS)
    assert small == graphs | {"xla_gpu_dot_merger_threshold_mb": step.SINGLE_DEVICE_DOT_MERGER_MB}
    large = step.step_compiler_options(one, step.SINGLE_DEVICE_MERGE_MAX_ROWS + 1)
    assert large == graphs | {"xla_gpu_dot_merger_threshold_mb": 0}
    apart = step.step_compiler_options(many, 8)
    assert apart["xla_gpu_dot_merger_threshold_mb"] == 0
    assert apart["xla_gpu_enable_command_buffer"] == step.GPU_COMMAND_BUFFER
    assert step.step_compiler_options(many, None) == graphs


@pytest.mark.parametrize(
    "mode, tokens, issue_barriers",
    [(ForwardMode.EXTEND, 4096, True), (ForwardMode.DECODE, 128, True),
     (ForwardMode.EXTEND, 4096, False)],
)  # fmt: skip
def test_two_gpu_exchange_windows_hold_the_other_micro_batchs_compute(mode, tokens, issue_barriers):
    # On two H200s the dispatch all-to-all windows held one small fusion (estimated
    # fill 0-0.3 over NVLink) and the exchange ran alone at run time. With the micro-batches
    # kept apart (step._run_tbo) every all-to-all window holds the other micro-batch's stage;
    # without the issue barriers the prefill dispatch windows are nearly empty again.
    if not aot.aot_available():
        pytest.skip("needs the aot extra (jax-cuda12-plugin)")
    # Three layers (DeepSeek-V3's dense first layer and two MoE layers): exchanges inside the
    # step and at its tail, each as in the preset's four.
    config = dataclasses.replace(config_lib.MoEConfig.deepseek_v3_gqa_reduced(), num_layers=3)
    jitted, args, options = aot_report.model_step_program(
        config, aot_report.h200_mesh(2, 1), mode=mode, tokens_per_rank=tokens,
        enable_tbo=True, dtype=jnp.bfloat16, tbo_issue_barriers=issue_barriers,
        moe=layer_ops.MoEOptions(ep_dedup=False),  # the per-(token, expert) all-to-all
    )  # fmt: skip
    text = jitted.lower(*args).compile(compiler_options=options).as_text()
    windows = [w for w in hlo_schedule.collective_windows(text) if w.kind == "all-to-all"]
    fills = [f.fill for f in schedule_costs.window_fill(text) if f.kind == "all-to-all"]
    assert len(windows) == 8  # 2 MoE layers x dispatch and combine x 2 micro-batches
    if not issue_barriers:  # nearly empty or synchronous (no window at all) exchanges
        assert sum(fill < 1.0 for fill in fills) + sum(not w.is_async for w in windows) >= 3
        return
    assert all(w.is_async for w in windows)
    if mode == ForwardMode.EXTEND:
        assert min(fills) >= 1.0, fills
    else:  # the last layer's tail: little of A is left beside B's last exchanges
        assert sum(fill < 1.0 for fill in fills) <= 2 and min(fills) >= 0.5, fills
    # The issue barriers pin the received payload whole: no copy of its rows may be made
    # between the exchange and the expert gather (it was a 466 MiB slice per layer and
    # micro-batch while dispatch_a sliced the rows from their id columns).
    assert not _copies_of_exchange_results(text)


def _copies_of_exchange_results(text: str) -> list[str]:
    """Entry fusions that read only an all-to-all result and write at least half its bytes."""
    entry = next(c for c in hlo_schedule.parse_module(text).values() if c.is_entry)
    done = {
        i.name: sum(hlo_schedule.shape_bytes(i.shape))
        for i in entry.instructions
        if i.opcode == "all-to-all-done"
    }
    return [
        i.name
        for i in entry.instructions
        if i.opcode == "fusion"
        and i.operands in {(name,) for name in done}
        and 2 * sum(hlo_schedule.shape_bytes(i.shape)) >= done[i.operands[0]]
    ]


def _parallel(dp: int, tp: int, **kwargs) -> layer_ops.ParallelConfig:
    moe = layer_ops.MoEOptions(moe_runner_backend="xla")
    return layer_ops.ParallelConfig.for_mesh(mesh_lib.make_mesh(dp, tp), moe=moe, **kwargs)


def test_issue_barriers_default_on_only_without_attention_tensor_parallelism():
    assert _parallel(2, 1).issue_barriers
    assert not _parallel(4, 2).issue_barriers
    assert _parallel(4, 2, tbo_issue_barriers=True).issue_barriers
    assert not _parallel(2, 1, tbo_issue_barriers=False).issue_barriers


def test_unknown_attention_backend_names_the_field():
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        _parallel(1, 1, attention_backend="flash")


def _peer_copy_windows(config, pin_issued: bool) -> list[hlo_schedule.CollectiveWindow]:
    """The peer-copy windows of a 2-device TBO extend step compiled for the CPU devices."""
    original = operations.execute_overlapped_operations

    def execute(*args, **kw):
        return original(*args, **{**kw, "pin_issued": kw["pin_issued"] and pin_issued})

    with mock.patch.object(operations, "execute_overlapped_operations", execute):
        jitted, args, options = aot_report.model_step_program(
            config, mesh_lib.make_mesh(2, 1),
            mode=ForwardMode.EXTEND, tokens_per_rank=64, enable_tbo=True, dtype=jnp.float32,
            moe=layer_ops.MoEOptions(ep_exchange="peer_copy"),
        )  # fmt: skip
        text = jitted.lower(*args).compile(compiler_options=options).as_text()
    windows = hlo_schedule.collective_windows(text)
    return [w for w in windows if w.kind == hlo_schedule.PEER_COPY_KIND]


def test_peer_copy_windows_hold_the_other_micro_batchs_compute():
    # The peer-copy exchange's start and wait are custom calls XLA schedules as ordinary
    # calls: the TBO step pins each start before the other micro-batch's next stage
    # (pin_issued), so every window from a start to its wait holds that stage's compute but
    # for B's last exchanges (A has finished by then), and more compute than without the pin.
    # Compiled for 2 CPU devices (the exchange's CPU twin): the schedule, not the run time.
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=3)
    pinned, free = (_peer_copy_windows(config, pin) for pin in (True, False))
    assert len(pinned) == len(free) == 4 * sum(config.is_moe_layer)  # dispatch and combine x 2
    other = {"tbo_a": "tbo_b", "tbo_b": "tbo_a"}
    held = [any(slot.micro_batch == other[w.micro_batch] for slot in w.between) for w in pinned]
    assert all(w.is_async for w in pinned) and sum(not h for h in held) <= 2, held
    assert sum(len(w.between) for w in pinned) > 1.5 * sum(len(w.between) for w in free)


def test_tbo_steps_run_moe_runner_backend_tbo_and_plain_steps_moe_runner_backend():
    moe = layer_ops.MoEOptions(moe_runner_backend="pallas")
    parallel = layer_ops.ParallelConfig.for_mesh(mesh_lib.make_mesh(1, 1), moe=moe)
    backend = lambda p, child: step.step_parallel(p, child).moe.moe_runner_backend  # noqa: E731
    assert backend(parallel, None) == backend(parallel, 8) == "pallas"  # None: the plain one
    fixed = dataclasses.replace(moe, moe_runner_backend_tbo="xla")
    fixed_parallel = dataclasses.replace(parallel, moe=fixed)
    assert (backend(fixed_parallel, None), backend(fixed_parallel, 8)) == ("pallas", "xla")
    with pytest.raises(ValueError, match="moe_runner_backend_tbo='cutlass'"):
        layer_ops.MoEOptions(moe_runner_backend_tbo="cutlass")


def test_program_name_follows_the_key():
    # Equal keys share a name (one persistent-cache entry for every runner); a runner's
    # programs of other buckets, TBO strategies or sampling each have their own.
    def key(capacity=128, child=None, mode=ForwardMode.EXTEND, sampler=None):
        return step.StepKey(capacity, None, mode, child, None, sampler)

    keys = (key(), key(64), key(child=64), key(child=64, mode=ForwardMode.DECODE),
            key(sampler=object()))  # fmt: skip
    names = [step.program_name(k) for k in keys]
    assert names[0] == step.program_name(key()) == "model_step_128"
    assert names[3] == "model_step_128_tbo64_decode"
    assert names[4] == "model_step_128_tokens"
    assert len(set(names)) == len(names)
