"""The step model's invariants (pure Python on the shipped table: no compiles)."""

import dataclasses
import math

import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.analysis import step_costs, step_exchange, step_model, step_ops
from jtbo.models import config as config_lib
from jtbo.models import layer_ops, step_operations
from jtbo.models import model as model_lib
from jtbo.models import step as step_lib
from jtbo.overlap import operations
from jtbo.split import ForwardMode

COSTS = step_costs.load()
SMALL = dataclasses.replace(config_lib.MoEConfig.deepseek_v3(), num_layers=5)
CASES = st.tuples(
    st.sampled_from(["prefill", "decode"]),
    st.sampled_from([2, 8, 32, 72]),
    st.sampled_from([32, 256, 2048, 8192]),
)
# jtbo's stack, SGLang's prefill (node) and decode (pairs) stacks, each in either mode
STACKS = st.sampled_from(
    [
        step_model.serving_stack(name, mode)
        for name in step_model.STACKS
        for mode in step_model.MODES
    ]
)


def _predict(mode, ep, tokens, gbps, slowdown=None, latency=0.0, stack=None):
    stack = stack or step_model.serving_stack("jtbo", mode)
    link = step_exchange.Link(gbps, latency, stack.engine)
    inputs = step_model.StepInputs(
        ep, mode, tokens, link, exchange=stack.exchange, decode_attention=stack.decode_attention,
        expert_gemm=stack.expert_gemm,
    )  # fmt: skip
    return step_model.predict(SMALL, inputs, COSTS, slowdown)


@settings(max_examples=12, deadline=None)
@given(CASES, STACKS)
def test_no_gain_without_communication(case, stack):
    mode, _, tokens = case
    made = _predict(mode, 1, tokens, 50.0, stack=stack)
    assert made.exchange_ms == 0 and made.traffic == dict(link_bytes=0, nvlink_bytes=0)
    assert made.tbo_ms >= made.plain_ms


@settings(max_examples=16, deadline=None)
@given(CASES, st.floats(1.0, 1000.0), STACKS)
def test_saving_bounded_by_overlap(case, gbps, stack):
    made = _predict(*case, gbps, slowdown=1.0, stack=stack)
    compute = sum(v["plain_ms"] for v in made.per_operation.values())
    comm = made.exchange_ms
    assert made.saving <= min(compute, comm) / (compute + comm) + 1e-9


@settings(max_examples=12, deadline=None)
@given(CASES, st.floats(1.0, 500.0), st.floats(1.01, 4.0), STACKS)
def test_monotone_in_link_bandwidth(case, gbps, factor, stack):
    slow, fast = _predict(*case, gbps, stack=stack), _predict(*case, gbps * factor, stack=stack)
    assert fast.plain_ms <= slow.plain_ms + 1e-9
    assert fast.tbo_ms <= slow.tbo_ms + 1e-9


def test_the_default_inputs_are_jtbos_stack():
    inputs = step_model.StepInputs(32, "prefill", 4096, step_exchange.Link(50.0))
    jtbo = step_model.serving_stack("jtbo", "prefill")
    assert (inputs.exchange, inputs.decode_attention, inputs.link.engine, inputs.expert_gemm) == (
        jtbo.exchange, jtbo.decode_attention, jtbo.engine, jtbo.expert_gemm,
    )  # fmt: skip


def test_sglang_stack_per_mode():
    prefill = step_model.serving_stack("sglang", "prefill")
    decode = step_model.serving_stack("sglang", "decode")
    assert (prefill.exchange.topology, prefill.engine) == ("node", "sm")
    assert (decode.exchange.topology, decode.engine) == ("pairs", "copy")
    for stack in (prefill, decode):
        assert (stack.exchange.dispatch_dtype, stack.exchange.combine_dtype) == ("fp8", "bf16")
        assert stack.decode_attention.price == "roofline"
        assert stack.expert_gemm == step_ops.ExpertGemm("fp8", step_model.FP8_OVER_BF16_RATE)
    assert step_model.serving_stack("jtbo", "decode").expert_gemm == step_ops.ExpertGemm()
    with pytest.raises(ValueError, match="stack"):
        step_model.serving_stack("vllm", "decode")


def test_roofline_attention_prices_decode_only():
    # the roofline replaces the decode kernel; prefill keeps the table's extend attention
    sglang = step_model.serving_stack("sglang", "decode")
    for mode, same in (("prefill", True), ("decode", False)):
        own = _predict(mode, 8, 256, 50.0)
        roofline = _predict(mode, 8, 256, 50.0, stack=dataclasses.replace(
            step_model.serving_stack("jtbo", mode), decode_attention=sglang.decode_attention,
        ))  # fmt: skip
        core = (own.per_operation["attn_core"], roofline.per_operation["attn_core"])
        assert (core[0] == core[1]) is same


def test_split_batch_keeps_tokens_and_cuts_a_prompt():
    a, b = step_model.split_batch(step_model.prefill_batch(4096, 4096))
    assert a.chunks == ((2048, 0),) and b.chunks == ((2048, 2048),)
    assert a.tokens + b.tokens == 4096


def test_hit_probability_counts_groups():
    v3 = config_lib.MoEConfig.deepseek_v3()
    routing = step_exchange.routing_for(v3, 32)
    expected = 31 * 0.5 * (1 - math.prod((120 - i) / (128 - i) for i in range(8)))
    assert routing.local_experts == 8
    assert routing.remote_gpus_per_token == pytest.approx(expected)


def test_predict_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        step_model.predict(
            SMALL, step_model.StepInputs(2, "train", 8, step_exchange.Link(1.0)), COSTS
        )


WEIGHTLESS = (
    "comm_prepare_attn", "select_experts", "dispatch_a", "dispatch_b", "combine_a", "combine_b",
    "output", "embed", "final_norm",
)  # fmt: skip


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_tbo_pays_weightless_operations_once(mode):
    # without an exchange (no slowdown) the two micro-batches' row-wise operations and decode
    # attention cost what the plain step's do: their per-call floor is paid once per step
    made = _predict(mode, 8, 256, 50.0, slowdown=1.0)
    names = WEIGHTLESS + (("attn_core",) if mode == "decode" else ())
    for name in names:
        times = made.per_operation[name]
        assert times["tbo_ms"] == pytest.approx(times["plain_ms"]), name


def test_merge_reads_last_rows_at_prefill_and_merges_logits_at_decode():
    prefill = _predict("prefill", 8, 4096, 50.0).per_operation
    assert "tbo_merge" not in prefill  # the LM head's rows are read from both halves
    rows = prefill["last_rows"]
    assert rows["tbo_ms"] == pytest.approx(rows["plain_ms"]) and rows["plain_ms"] > 0
    decode = _predict("decode", 8, 256, 50.0).per_operation
    logits = COSTS.rowwise("gather", 256, 2 * SMALL.vocab_size)
    assert decode["tbo_merge"] == dict(plain_ms=0.0, tbo_ms=pytest.approx(logits))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_host_time_is_an_input_added_once_per_step(mode):
    link = step_exchange.Link(50.0)
    inputs = step_model.StepInputs(8, mode, 256, link)
    table = step_model.predict(SMALL, inputs, COSTS)
    given_host = step_model.predict(SMALL, dataclasses.replace(inputs, host_ms=2.0), COSTS)
    for key, tbo in (("plain_ms", False), ("tbo_ms", True)):
        extra = getattr(given_host, key) - getattr(table, key)
        assert extra == pytest.approx(2.0 - COSTS.step_host_ms(mode, tbo))
    with pytest.raises(ValueError, match="host_ms"):
        step_model.StepInputs(8, mode, 256, link, host_ms=-1.0)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_fp8_experts_change_only_the_experts_and_never_slow_them(mode):
    bf16 = _predict(mode, 8, 2048, 50.0).per_operation
    fp8_stack = dataclasses.replace(
        step_model.serving_stack("jtbo", mode), expert_gemm=step_ops.ExpertGemm("fp8", 1.5)
    )
    fp8 = _predict(mode, 8, 2048, 50.0, stack=fp8_stack).per_operation
    for name, times in bf16.items():
        if name == "experts":
            assert fp8[name]["plain_ms"] < times["plain_ms"]
            assert fp8[name]["tbo_ms"] < times["tbo_ms"]
        else:
            assert fp8[name]["plain_ms"] == pytest.approx(times["plain_ms"]), name


def test_expert_gemm_inputs_are_checked():
    with pytest.raises(ValueError, match="need fp8_speedup"):
        step_ops.ExpertGemm("fp8")
    with pytest.raises(ValueError, match="no FP8 speedup"):
        step_ops.ExpertGemm("bf16", 2.0)
    with pytest.raises(ValueError, match="dtype"):
        step_ops.ExpertGemm("int4")


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_one_gpu_tbo_runs_in_lockstep_with_joint_operations(mode):
    # At EP 1 jtbo runs the micro-batches in lockstep: the routed experts once over both
    # micro-batches' rows (their weights read once), small micro-batches' row-wise operations
    # too; staggered micro-batches (EP 2) read the experts' weights each.
    lockstep = _predict(mode, 1, 256, 50.0).per_operation
    for name in ("experts", "select_experts", "attn_prepare", "shared_experts", "gate"):
        assert lockstep[name]["tbo_ms"] == pytest.approx(lockstep[name]["plain_ms"]), name
    staggered = _predict(mode, 2, 256, 50.0).per_operation
    assert staggered["experts"]["tbo_ms"] > 1.2 * staggered["experts"]["plain_ms"]


def test_one_gpu_lockstep_joins_row_wise_operations_of_small_micro_batches_only():
    rows = 2 * step_lib.SINGLE_DEVICE_MERGE_MAX_ROWS + 512  # micro-batches past the bound
    large = _predict("prefill", 1, rows, 50.0).per_operation
    assert large["experts"]["tbo_ms"] == pytest.approx(large["experts"]["plain_ms"])
    assert large["attn_prepare"]["tbo_ms"] != pytest.approx(large["attn_prepare"]["plain_ms"])


def test_lockstep_order_refuses_different_operations():
    op = step_model.step_schedule.Op
    with pytest.raises(ValueError, match="same operations"):
        step_model.lockstep_order([[op("gate", 1.0)]], [[[op("gate", 0.5)]], [[op("mlp", 0.5)]]], 8)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_joint_and_row_wise_names_are_the_step_operations_marks(mode):
    model = model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(0))
    parallel = layer_ops.ParallelConfig(1, layer_ops.MoEOptions(moe_runner_backend="xla"))
    ops, _ = step_operations.step_operations(model, parallel, mode)
    by_name = {
        op.debug_name.split(".")[-1]: op
        for op in ops if isinstance(op, operations.ExecutionOperation)
    }  # fmt: skip
    joint = {name for name, op in by_name.items() if op.joint_fn is not None}
    row_wise = {name for name, op in by_name.items() if op.row_wise}
    assert joint == step_model.JOINT_OPERATIONS & by_name.keys() and joint
    assert row_wise == step_model.ROW_WISE_OPERATIONS & by_name.keys() and row_wise
