"""The physical limit's work counts against the model's own parameters.

The reference counts what the model holds (``MoEModel``'s parameter shapes, built abstractly):
every matrix a token passes through, the routed experts scaled by ``top_k / E``; and the
attention pairs from an explicit causal mask. ``limits`` derives the same from the config.
"""

import dataclasses
import math

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.bench import limits
from jtbo.models import config as config_lib
from jtbo.models import model as model_lib

_PRESETS = config_lib.MoEConfig
CONFIGS = {
    "tiny": _PRESETS.tiny(),
    "tiny_mla": _PRESETS.tiny_mla(),
    "mla_without_q_lora": dataclasses.replace(_PRESETS.tiny_mla(), q_lora_rank=None),
    "softmax_gated_tied_bias": dataclasses.replace(
        _PRESETS.tiny_softmax(),
        num_shared_experts=1,
        shared_expert_gate=True,
        tie_word_embeddings=True,
        qkv_bias=True,
    ),  # fmt: skip
}
NOT_MATMUL = ("correction_bias", "bqkv")  # biases: added, not multiplied


def _model_weights(config):
    """``(per-token weights, routed-expert weights, heads, qk width, v width)`` of the model."""
    model = nnx.eval_shape(lambda: model_lib.MoEModel(config, rngs=nnx.Rngs(0)))
    per_token = routed = 0
    shapes = {}
    for path, state in nnx.state(model).flat_state():
        names = [part for part in path if isinstance(part, str)]
        shape = state.get_value().shape
        size = math.prod(shape)
        shapes[names[-2], names[-1]] = shape
        if names[-1] in NOT_MATMUL or any("norm" in name for name in names):
            continue
        if names[-1] == "table":  # gathered; read whole only as a tied LM head
            per_token += size if config.tie_word_embeddings else 0
        elif "experts" in names:
            routed += size
        else:
            per_token += size
    heads, v_width, _ = shapes["attn", "wo"]
    query = shapes.get(("attn", "wqkv")) or shapes.get(("attn", "wq_b")) or shapes["attn", "wq"]
    return per_token, routed, heads, query[-1], v_width


@pytest.mark.parametrize("name", CONFIGS)
@settings(max_examples=10, deadline=None)
@given(seq_lens=st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_prefill_flops_count_the_models_matmuls_and_causal_pairs(name, seq_lens):
    config = CONFIGS[name]
    per_token, routed, heads, qk, v = _model_weights(config)
    pairs = sum(int(np.tril(np.ones((n, n), bool)).sum()) for n in seq_lens)
    top_k, experts = config.num_experts_per_tok, config.num_experts
    tokens = sum(seq_lens)
    want = 2 * (tokens * (per_token + routed * top_k / experts))
    want += 2 * pairs * heads * (qk + v) * config.num_layers
    assert limits.attention_pairs(seq_lens) == pairs
    assert limits.prefill_flops(config, seq_lens) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("num_devices", [1, 2, 8])
def test_decode_bytes_are_the_devices_weights_and_the_kv_it_attends(name, num_devices):
    config = CONFIGS[name]
    per_token, routed, *_ = _model_weights(config)
    if config.attention_kind == "mla":  # one latent row of rank + rope values
        kv_values = config.kv_lora_rank + config.qk_rope_head_dim
    else:  # keys and values of every KV head
        kv_values = 2 * config.num_key_value_heads * config.head_dim
    context = 3 * 257
    want = (per_token + routed / num_devices) * 2 + context * config.num_layers * kv_values * 2
    assert limits.decode_bytes(config, context, num_devices, 2) == pytest.approx(want, rel=1e-12)
    # FP8 routed experts: one byte a value, plus a float32 scale per block of each matrix.
    fp8 = dataclasses.replace(config, expert_dtype="float8_e4m3fn", expert_block_size=(16, 16))
    h, f = config.hidden_size, config.moe_intermediate_size
    scales = 3 * -(-h // 16) * -(-f // 16) * 4 * routed // (3 * h * f)
    want_fp8 = want - (routed - scales) / num_devices  # routed * 2 bytes -> routed + scales
    assert limits.decode_bytes(fp8, context, num_devices, 2) == pytest.approx(want_fp8, rel=1e-12)


def test_the_limit_is_the_work_at_the_rate():
    prefill = limits.Limit(work=19.31e12, unit="TFLOP", rate=712.0, rate_label="bf16 matmul")
    assert prefill.milliseconds == pytest.approx(19.31 / 712 * 1e3)
    line = prefill.describe(2 * prefill.milliseconds)
    assert line.startswith("19.31 TFLOP at 712 TFLOP/s (bf16 matmul) = 27.12 ms; step 54.24 ms")
    assert line.endswith("= 2.00x")
    decode = limits.Limit(work=21.0e9, unit="GB", rate=4200.0, rate_label="torch copy_")
    assert decode.milliseconds == pytest.approx(5.0)
