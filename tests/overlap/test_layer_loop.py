"""TBO == plain == float64 numpy on the toy stack with real collectives over 8 CPU devices."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.collectives import mesh as mesh_lib
from jtbo.overlap import layer_loop, strategy, toy_stack

ForwardMode = strategy.ForwardMode
DP, TOKENS = 8, 16


def _erf_gelu(x):
    # jax.nn.gelu's default is the tanh approximation
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _norm(x, scale):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def _reference(weights, config, hidden, residual, positions, num_tokens):
    """Per-token float64 forward (dense MoE over each token's top-k), rows past n zeroed."""
    w = [jax.tree.map(lambda a: np.asarray(a, np.float64), layer) for layer in weights]
    h, r = np.asarray(hidden, np.float64), np.asarray(residual, np.float64)
    inv_freq = 1.0 / (10000.0 ** (np.arange(config.hidden_size) / config.hidden_size))
    angle = np.asarray(positions, np.float64)[:, None] * inv_freq
    for layer in w:
        r = h + r
        q, k, v = np.split(_norm(r, layer.attn_norm) @ layer.qkv_proj, 3, -1)
        rotated = q * np.cos(angle) + k * np.sin(angle)
        r = r + (1 / (1 + np.exp(-rotated)) * v) @ layer.o_proj
        x = _norm(r, layer.mlp_norm)
        logits = x @ layer.router
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, -1)[:, : config.top_k]
        routed = np.zeros_like(x)
        for t in range(x.shape[0]):
            for e in top[t]:
                expert = _erf_gelu(x[t] @ layer.expert_up[e]) @ layer.expert_down[e]
                routed[t] += probs[t, e] * expert
        shared = _erf_gelu(x @ layer.shared_up) @ layer.shared_down if config.shared_experts else 0
        h = routed + shared
    valid = (np.arange(h.shape[0]) % TOKENS) < np.repeat(num_tokens, TOKENS)
    return h * valid[:, None], r * valid[:, None]


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.make_mesh(DP, 1)


def _inputs(config, num_tokens):
    keys = jax.random.split(jax.random.key(7), 2)
    shape = (DP * TOKENS, config.hidden_size)
    valid = (np.arange(DP * TOKENS) % TOKENS) < np.repeat(num_tokens, TOKENS)
    hidden = jax.random.normal(keys[0], shape) * valid[:, None]
    residual = jax.random.normal(keys[1], shape) * valid[:, None]
    positions = jnp.asarray(np.tile(np.arange(TOKENS), DP) * valid, jnp.int32)
    return hidden, residual, positions


# (mode, split per DP rank, real tokens per DP rank): prefill with uneven balanced splits, a
# two-chunk-like split at n // 2 inside one prompt, decode at half the sequences, and verify
# with 4 tokens per sequence (splits on sequence boundaries).
CASES = {
    "prefill": (ForwardMode.EXTEND, [5, 9, 3, 10, 7, 1, 12, 8], [16, 16, 12, 14, 16, 9, 16, 16]),
    "two_chunk": (ForwardMode.EXTEND, [8, 8, 7, 5, 8, 6, 8, 8], [16, 16, 15, 11, 16, 13, 16, 16]),
    "decode": (ForwardMode.DECODE, [8, 4, 6, 8, 2, 8, 5, 8], [16, 8, 12, 16, 4, 16, 10, 16]),
    "verify": (ForwardMode.TARGET_VERIFY, [8, 4, 8, 8, 4, 8, 4, 8], [16, 8, 16, 16, 8, 16, 8, 16]),
}


@functools.cache
def _step(mesh, config, options):
    return toy_stack.make_step(mesh, config, options)


@pytest.mark.parametrize(
    "case, moe",
    [(case, "ep") for case in sorted(CASES)] + [("prefill", "dp"), ("decode", "dp")],
)
def test_tbo_matches_plain_and_numpy(mesh, case, moe):
    mode, split, num_tokens = CASES[case]
    config = toy_stack.ToyStackConfig(
        num_layers=2, hidden_size=16, moe_intermediate_size=32, num_experts=8, top_k=2, moe=moe
    )
    weights = toy_stack.init_weights(jax.random.key(3), config)
    hidden, residual, positions = _inputs(config, num_tokens)
    args = (weights, hidden, residual, positions, jnp.asarray(split), jnp.asarray(num_tokens))
    # the layout only depends on prefill vs decode: reuse one compile per layout
    layout_mode = ForwardMode.EXTEND if mode is ForwardMode.EXTEND else ForwardMode.DECODE
    plain = _step(
        mesh, config, toy_stack.ToyStepOptions(forward_mode=layout_mode, enable_tbo=False)
    )(*args)
    tbo = _step(mesh, config, toy_stack.ToyStepOptions(forward_mode=mode, child_capacity=12))(*args)
    expected = _reference(weights, config, hidden, residual, positions, np.asarray(num_tokens))
    valid = ((np.arange(DP * TOKENS) % TOKENS) < np.repeat(num_tokens, TOKENS))[:, None]
    chex.assert_trees_all_close(tuple(t * valid for t in plain), expected, atol=2e-4, rtol=2e-4)
    chex.assert_trees_all_close(tbo, expected, atol=2e-4, rtol=2e-4)
    chex.assert_trees_all_close(tbo, tuple(p * valid for p in plain), atol=1e-5, rtol=1e-5)


def test_qwen3_family_and_no_barriers(mesh):
    config = toy_stack.ToyStackConfig(
        num_layers=2, hidden_size=16, moe_intermediate_size=32, num_experts=8, shared_experts=False
    )
    weights = toy_stack.init_weights(jax.random.key(4), config)
    num_tokens = [16] * DP
    hidden, residual, positions = _inputs(config, num_tokens)
    split = jnp.asarray([3, 8, 13, 8, 8, 1, 15, 8])
    args = (weights, hidden, residual, positions, split, jnp.asarray(num_tokens))
    options = toy_stack.ToyStepOptions(forward_mode=ForwardMode.DECODE, barriers=False)
    got = toy_stack.make_step(mesh, config, options)(*args)
    expected = _reference(weights, config, hidden, residual, positions, np.asarray(num_tokens))
    chex.assert_trees_all_close(got, expected, atol=2e-4, rtol=2e-4)


def test_one_trace_across_split_indices(mesh):
    config = toy_stack.ToyStackConfig(
        num_layers=1, hidden_size=16, moe_intermediate_size=16, num_experts=8
    )
    weights = toy_stack.init_weights(jax.random.key(5), config)
    body = toy_stack._step_body

    @chex.assert_max_traces(n=1)
    def traced_body(*args, **kwargs):
        return body(*args, **kwargs)

    toy_stack._step_body = traced_body
    try:
        step = toy_stack.make_step(mesh, config, toy_stack.ToyStepOptions())
        hidden, residual, positions = _inputs(config, [16] * DP)
        for split in ([8] * DP, [3, 5, 7, 9, 11, 13, 2, 8], [16] * DP, [0] * DP):
            num_tokens = jnp.full((DP,), 16, jnp.int32)
            out = step(weights, hidden, residual, positions, jnp.asarray(split), num_tokens)
            assert bool(jnp.all(jnp.isfinite(out[0])))
    finally:
        toy_stack._step_body = body
        chex.clear_trace_counter()


def test_tbo_needs_a_split_and_a_mode():
    ops = [{}]
    x = jnp.zeros((4, 2))
    with pytest.raises(ValueError, match="no forward mode"):
        layer_loop.model_forward_maybe_tbo(ops, True, jnp.zeros(4), None, x, x)
    with pytest.raises(ValueError, match="tbo_split"):
        layer_loop.model_forward_maybe_tbo(
            [_identity_layer()], True, jnp.zeros(4), None, x, x, forward_mode=ForwardMode.EXTEND
        )


def _identity_layer():
    names = strategy.layout_names(strategy.LayerFamily.DEEPSEEK, ForwardMode.EXTEND)
    ops = {name: (lambda state, **kw: kw) for name in names if name != strategy.YIELD}
    return ops
