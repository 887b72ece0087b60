"""Hugging Face checkpoints served by ModelRunner match transformers (float32 fixtures).

Per family, the fixture's prompts run as one EXTEND step (one prompt per DP rank) through
``ModelRunner.forward`` with TBO off and on, on 8 CPU devices, and the logits are compared
with transformers' float32 logits. Then the TBO runner's greedy ``generate`` (two prompts on
each of DP ranks 0 and 1, so that the decode steps split too) must reproduce transformers'
greedy tokens. Tolerance: atol = rtol = 1e-4 (float32 end to end; the differences seen are
~2e-6 on logits of magnitude ~4: summation order only).

Layouts: qwen2_moe (the family with every option: shared expert and its gate, q/k/v bias,
dense layers before and after a MoE layer, linear RoPE scaling) runs dp=8 x attn_tp=1 and
dp=4 x attn_tp=2; qwen3_moe runs 4 x 2 (attention heads split) and mixtral 8 x 1, so both
layouts meet every family's particular layers while keeping the compiles few. The DeepSeek
families (MLA: extend attends decompressed, the greedy decode steps absorbed) run
deepseek_v2 (no low-rank query, group_limited_greedy, two shared experts) on 4 x 2, heads
split and the latent replicated, and deepseek_v3 (low-rank query, noaux_tc with the correction
bias, YaRN with its mscales) on 8 x 1.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo import split
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import hf
from jtbo.runner import runner as runner_lib
from jtbo.runner import tbo_options
from tests.models.hf import fixtures

TOL = dict(atol=1e-4, rtol=1e-4)
CASES = [
    ("qwen2_moe", 8, 1), ("qwen2_moe", 4, 2), ("qwen3_moe", 4, 2), ("mixtral", 8, 1),
    ("deepseek_v2", 4, 2), ("deepseek_v3", 8, 1),
]  # fmt: skip


def _extend(prompt: list[int]) -> split.ForwardBatch:
    n = len(prompt)
    return split.ForwardBatch(
        forward_mode=split.ForwardMode.EXTEND, batch_size=1, input_ids=np.asarray(prompt),
        positions=np.arange(n), out_cache_loc=np.arange(1, n + 1), req_pool_indices=[0],
        seq_lens=[n], extend_seq_lens=[n], extend_prefix_lens=[0],
    )  # fmt: skip


@pytest.mark.parametrize("family, dp, tp", CASES)
def test_runner_matches_transformers_logits_and_greedy_tokens(family, dp, tp):
    model = hf.from_pretrained(fixtures.directory(family), dtype=jnp.float32)
    reference = fixtures.reference(family)
    prompts, want_logits = reference["prompt_ids"], fixtures.reference_logits(family)
    mesh = mesh_lib.make_mesh(dp, tp)
    batches = [_extend(prompts[rank]) if rank < len(prompts) else None for rank in range(dp)]
    for tbo in (False, True):
        runner = runner_lib.ModelRunner(
            model, mesh, tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo),
            max_total_tokens=128,
            max_running_requests=4, token_buckets=(16, 64), dtype=jnp.float32,
        )  # fmt: skip
        logits = runner.forward(batches)
        assert runner.num_tbo_steps == int(tbo)
        for got, want in zip(logits, want_logits, strict=False):
            chex.assert_trees_all_close(got, want, **TOL)
    results = runner.generate(
        prompts, max_new_tokens=reference["max_new_tokens"], chunk_size=64,
        dp_rank_of=lambda index: index // 2,
    )  # fmt: skip
    assert [r.token_ids for r in results] == reference["greedy_tokens"]
    assert runner.num_tbo_steps == runner.num_steps  # the decode steps ran TBO too
