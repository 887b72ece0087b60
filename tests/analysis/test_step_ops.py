"""The step model's per-operation pricing: attention, the roofline decode attention."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jtbo.analysis import step_costs, step_ops
from jtbo.models import config as config_lib

V3 = config_lib.MoEConfig.deepseek_v3()


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
