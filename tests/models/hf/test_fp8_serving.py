"""An FP8 checkpoint served with its routed experts kept FP8, TBO on and off.

The deepseek_v3 fixture written as DeepSeek publishes V3 (``F8_E4M3`` matrices with
``_scale_inv`` factors, here in 16 x 16 blocks), cut to its dense and its first MoE layer
(fewer compiles), is loaded with
``expert_dtype="float8_e4m3fn"`` onto 8 CPU devices (EP over all 8: one expert each, the
dispatch and combine through the all-to-all) and served by ``generate``, greedy, with TBO off
and on, the experts through the FP8 Pallas kernel (``moe_runner_backend="pallas"``, its
interpreter on the CPU). Both must give the same tokens, and those of a greedy loop over the
unsharded reference forward of the same model (its experts dequantized to float32; the
kernel scales float32 partial products of the same values, so both compute the same sums up
to float32 rounding).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import hf, layer_ops, reference
from jtbo.runner import runner as runner_lib
from jtbo.runner import tbo_options
from tests.models.hf import fixtures

NEW_TOKENS = 4


def _reference_greedy(model, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        tokens.append(int(np.argmax(reference.reference_causal_logits(model, tokens)[-1])))
    return tokens[len(prompt) :]


def test_fp8_checkpoint_serves_fp8_experts_with_tbo_on_and_off(tmp_path):
    fixtures.write_fp8_checkpoint(tmp_path / "fp8", (16, 16), num_layers=2)
    mesh = mesh_lib.make_mesh(8, 1)
    model = hf.from_pretrained(
        tmp_path / "fp8", dtype=jnp.float32, mesh=mesh, expert_dtype="float8_e4m3fn"
    )
    assert model.layers[1].moe.experts.w_down[...].dtype == jnp.float8_e4m3fn
    prompts = fixtures.reference("deepseek_v3")["prompt_ids"]
    served = {}
    for tbo in (False, True):
        runner = runner_lib.ModelRunner(
            model, mesh, tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo),
            max_total_tokens=128, max_running_requests=4, token_buckets=(64,),
            dtype=jnp.float32, moe=layer_ops.MoEOptions(moe_runner_backend="pallas"),
        )  # fmt: skip
        results = runner.generate(
            prompts, max_new_tokens=NEW_TOKENS, chunk_size=64, dp_rank_of=lambda i: i // 2
        )
        served[tbo] = [r.token_ids for r in results]
        dtypes = {leaf.dtype for leaf in jax.tree.leaves(runner.engine.params)}
        assert jnp.dtype(jnp.float8_e4m3fn) in dtypes  # the device parameters keep FP8 experts
        assert runner.num_tbo_steps == (runner.num_steps if tbo else 0)
    assert served[True] == served[False]
    assert served[False] == [_reference_greedy(model, prompt) for prompt in prompts]
