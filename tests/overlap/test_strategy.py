"""SGLang's stage layouts, chosen from the global forward mode."""

import pytest

from jtbo.overlap import operations, strategy

ForwardMode = strategy.ForwardMode
Family = strategy.LayerFamily


def _layer(family):
    layout, _ = strategy.layer_layout(family, ForwardMode.EXTEND)
    names = {n for n in layout if n != strategy.YIELD}
    return {name: (lambda state, _n=name: None) for name in names}


def _stages(ops):
    return [
        [op.debug_name.split(".", 1)[1] for op in stage]
        for stage in operations.convert_operations_to_stages(ops)
    ]


def test_deepseek_prefill_layout():
    s = strategy.OperationsStrategy.init_new_tbo([_layer(Family.DEEPSEEK)], ForwardMode.EXTEND)
    assert s.tbo_delta_stages == 0
    assert _stages(s.operations) == [
        ["comm_prepare_attn", "attn_prepare", "attn_core", "comm_prepare_mlp", "gate"]
        + ["select_experts", "dispatch_a"],
        ["dispatch_b", "experts", "combine_a"],
        ["shared_experts", "combine_b", "output", "comm_postprocess_layer"],
    ]


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_deepseek_decode_layout_two_layers(mode):
    layers = [_layer(Family.DEEPSEEK)] * 2
    s = strategy.OperationsStrategy.init_new_tbo(layers, mode)
    assert s.tbo_delta_stages == 2
    stages = _stages(s.operations)
    assert stages[:6] == [
        ["comm_prepare_attn", "attn_prepare"],
        ["attn_core", "comm_prepare_mlp", "gate", "select_experts"],
        ["dispatch_a", "shared_experts"],
        ["dispatch_b", "experts", "combine_a"],
        ["combine_b"],
        ["output", "comm_postprocess_layer", "comm_prepare_attn", "attn_prepare"],
    ]
    assert len(stages) == 11
    assert [op.debug_name for op in s.operations if not isinstance(op, operations.YieldOperation)][
        14
    ].startswith("L1.")


def test_qwen3_layouts():
    layer = _layer(Family.QWEN3_MOE)
    assert "shared_experts" not in layer
    prefill = strategy.OperationsStrategy.init_new_tbo(
        [layer], ForwardMode.EXTEND, Family.QWEN3_MOE
    )
    assert _stages(prefill.operations)[2] == ["combine_b", "output", "comm_postprocess_layer"]
    decode = strategy.OperationsStrategy.init_new_tbo([layer], ForwardMode.DECODE, Family.QWEN3_MOE)
    assert decode.tbo_delta_stages == 2
    assert _stages(decode.operations)[2:] == [
        ["dispatch_a"],
        ["dispatch_b", "experts", "combine_a"],
        ["combine_b", "output", "comm_postprocess_layer"],
    ]


def test_mixed_takes_prefill_and_bad_modes_raise():
    assert strategy.layout_kind(ForwardMode.MIXED) == "prefill"
    for mode in (ForwardMode.IDLE, ForwardMode.DRAFT_EXTEND, ForwardMode.PREBUILT):
        with pytest.raises(ValueError, match=mode.name):
            strategy.layout_kind(mode)


def test_layer_names_are_checked():
    layer = _layer(Family.DEEPSEEK)
    with pytest.raises(ValueError, match="not in the layout \\['shared_experts'\\]"):
        strategy.OperationsStrategy.init_new_tbo([layer], ForwardMode.EXTEND, Family.QWEN3_MOE)
    del layer["gate"]
    with pytest.raises(ValueError, match="missing \\['gate'\\]"):
        strategy.OperationsStrategy.init_new_tbo([layer], ForwardMode.EXTEND)
    with pytest.raises(ValueError, match="at least one layer"):
        strategy.OperationsStrategy.init_new_tbo([], ForwardMode.EXTEND)


def test_concat_checks_deltas():
    a = strategy.OperationsStrategy(operations=(), tbo_delta_stages=0)
    b = strategy.OperationsStrategy(operations=(), tbo_delta_stages=2)
    with pytest.raises(ValueError, match="disagree"):
        strategy.OperationsStrategy.concat([a, b])


def test_layer_operations_keep_a_joint_form():
    def fn(state):
        return None

    def joint(states, inputs):
        return None, None

    layout = ("a", strategy.YIELD, "b")
    ops = strategy.layer_operations(3, dict(a=fn, b=operations.JointOperation(fn, joint)), layout)
    assert ops[0] == operations.ExecutionOperation("L3.a", fn)
    assert isinstance(ops[1], operations.YieldOperation)
    assert ops[2] == operations.ExecutionOperation("L3.b", fn, joint)


def test_layer_operations_keep_the_issuing_mark_and_read_no_name():
    def fn(state):
        return None

    layout = ("send_a", strategy.YIELD, "send_b")
    named = dict(send_a=fn, send_b=operations.IssuingOperation(fn))
    first, _, second = strategy.layer_operations(0, named, layout)
    assert not first.issues_collective and second.issues_collective
