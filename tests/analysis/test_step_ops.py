"""The step model's per-operation pricing: attention, the roofline decode attention."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.analysis import step_costs, step_ops
from jtbo.models import config as config_lib

V3 = config_lib.MoEConfig.deepseek_v3()
GQA = config_lib.MoEConfig.deepseek_v3_gqa_reduced()


@given(st.integers(1, 512), st.integers(1, 8192), st.floats(100.0, 5000.0))
def test_roofline_attention_is_the_kv_bytes_over_the_rate(seqs, context, gbps):
    costs = step_costs.load()
    batch = step_ops.Batch(float(seqs), decode_context=context)
    roofline = step_ops.DecodeAttention("roofline", gbps)
    core = step_ops.attention_costs(costs, V3, batch, roofline)["attn_core"]
    assert step_ops.kv_bytes_per_token(V3) == (512 + 64) * 2
    assert core == pytest.approx(seqs * context * 1152 / (gbps * 1e9) * 1e3, rel=1e-12)


def test_bad_decode_attention_names_the_problem():
    with pytest.raises(ValueError, match="needs gbps"):
        step_ops.DecodeAttention("roofline")
    with pytest.raises(ValueError, match="takes no rate"):
        step_ops.DecodeAttention("measured", 3000.0)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([V3, GQA]), st.integers(2, 4096), st.sampled_from([0, 1024, 4096]))
def test_micro_batches_share_one_call_of_weightless_operations(config, tokens, context):
    # two halves of a step pay the row-wise operations and decode attention once between them
    whole = step_ops.Batch(float(tokens), decode_context=context)
    half = step_ops.Batch(tokens / 2, decode_context=context, step_tokens=float(tokens))
    costs = step_costs.load()
    for name in ("comm_prepare_attn",) + (("attn_core",) if context else ()):
        parts = step_ops.attention_costs(costs, config, half)[name]
        assert 2 * parts == pytest.approx(step_ops.attention_costs(costs, config, whole)[name])
    for op in step_costs.ROWWISE_OPS:
        parts = step_ops.rowwise_ms(costs, op, half, config.hidden_size, 3.0)
        assert 2 * parts == pytest.approx(costs.rowwise(op, 3.0 * tokens, config.hidden_size))
