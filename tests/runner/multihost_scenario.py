"""The serving scenario of the multi-host test, run alike by one process and by several.

Every process builds the same tiny model (fixed seed, one dense and one MoE layer) on a
``(4, 2)`` mesh over all devices and the same host batches for all DP ranks; each passes only
its own ranks' batches (``runner.local_dp_ranks``). Results are keyed by global DP rank, so the
outputs of all processes together can be compared with a single-process run's.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import layer_ops
from jtbo.models import model as model_lib
from jtbo.runner import runner as runner_lib
from jtbo.runner import sampling, tbo_options
from tests.runner import helpers

DP, ATTN_TP = 4, 2
BUCKETS = (32,)  # one bucket: fewer compiles in each of the three processes
# One dense and one MoE layer: every program of the scenario compiles fewer layers in each
# process; what is checked (the processes together equal one) does not depend on the depth.
CONFIG = helpers.TWO_LAYER_TINY
NEW_TOKENS = 4
# Per step, per DP rank: EXTEND new-token lengths per request, "decode", or None (idle).
# Step 0: balanced split, a two-chunk prompt, an idle rank; step 1 extends the same requests
# (prefixes); then decode, with all of process 1's ranks idle in the last step.
SCRIPT = (
    ([5, 3, 4], [14], [2, 6], None),
    ([2, 2, 3], [9], [4, 1], None),
    ("decode", "decode", "decode", None),
    ("decode", "decode", None, None),
)


def make_runner(
    tbo: bool | str, buckets=BUCKETS, tbo_kwargs=None, **kwargs
) -> runner_lib.ModelRunner:
    """A float32 runner of ``CONFIG`` (seed 0) on a (4, 2) mesh of all devices
    (``tbo_kwargs``: further ``TboOptions`` fields; ``kwargs``: further runner keywords)."""
    model = model_lib.MoEModel(CONFIG, rngs=nnx.Rngs(0))
    tbo = tbo_options.TboOptions(enable_two_batch_overlap=tbo, **(tbo_kwargs or {}))
    return runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(DP, ATTN_TP), tbo=tbo,
        moe=layer_ops.MoEOptions(moe_a2a_backend="ep"), max_total_tokens=64,
        max_running_requests=4, token_buckets=buckets, dtype=jnp.float32, **kwargs,
    )  # fmt: skip


# Per process, (plain ms, TBO ms) an "auto" runner's timer reports for each mode. Alone,
# process 0 would keep TBO for EXTEND (9.0 <= 9.8) and process 1 would not (9.9 > 9.8): the
# processes would run different programs. Agreed (max per program): EXTEND plain, DECODE TBO.
AUTO_TIMINGS = {
    "EXTEND": ((10.0, 9.0), (10.0, 9.9)),
    "DECODE": ((10.0, 9.0), (9.0, 9.5)),
}


def process_timer(shape, use_tbo, run):
    """A ``tbo_auto.StepTimer`` reporting this process's ``AUTO_TIMINGS`` (runs the step)."""
    run()
    return AUTO_TIMINGS[shape.mode.name][jax.process_index()][int(use_tbo)]


def serve_auto() -> dict:
    """The forward script on an "auto" runner whose processes time differently.

    Returns:
      ``{"auto/logits/<step>/<rank>": ..., "auto/decisions": [(mode, bucket, use_tbo,
      plain_ms, tbo_ms)], "auto/tbo_steps": int}``.
    """
    runner = make_runner("auto", tbo_kwargs=dict(tbo_timer=process_timer, tbo_auto_trials=1))
    out = {f"auto/{k}": v for k, v in forward_script(runner).items()}
    out["auto/decisions"] = [
        (d.shape.mode.name, d.shape.capacity, d.use_tbo, d.plain_ms, d.tbo_ms)
        for d in runner.tbo_decisions()
    ]
    out["auto/tbo_steps"] = runner.num_tbo_steps
    return out


def _batches(ranks, step, rng):
    out = []
    for rank, work in zip(ranks, SCRIPT[step], strict=True):
        if work is None:
            out.append(None)
        elif work == "decode":
            out.append(rank.decode({row: int(rng.integers(128)) for row in rank.tokens}))
        else:
            out.append(rank.extend({row: rng.integers(0, 128, n).tolist() for row, n in
                                    enumerate(work)}))  # fmt: skip
    return out


def forward_script(runner) -> dict:
    """Runs ``SCRIPT``; returns ``{"logits/<step>/<rank>": [tokens, vocab]}`` for own ranks."""
    rng = np.random.default_rng(0)
    ranks = [helpers.Rank() for _ in range(DP)]
    out = {}
    for step in range(len(SCRIPT)):
        batches = _batches(ranks, step, rng)  # every rank's, built alike on every process
        logits = runner.forward([batches[r] for r in runner.local_dp_ranks])
        for rank, rows in zip(runner.local_dp_ranks, logits, strict=True):
            if rows is not None:
                out[f"logits/{step}/{rank}"] = rows
    return out


def prompts() -> list[list[int]]:
    """Ten random prompts and one the runner must refuse (outside the vocabulary)."""
    rng = np.random.default_rng(5)
    out = [rng.integers(0, 128, int(n)).tolist() for n in rng.integers(3, 12, 10)]
    out.insert(4, [1, 2, 500])
    return out


def serve(tbo: bool) -> tuple[dict, runner_lib.ModelRunner]:
    """The forward script, then greedy generation of ``prompts()``, on a fresh runner.

    Returns the results and the runner.
    """
    runner = make_runner(tbo)
    out = {f"{tbo}/{k}": v for k, v in forward_script(runner).items()}
    results = runner.generate(prompts(), max_new_tokens=NEW_TOKENS, chunk_size=8)
    out[f"{tbo}/tokens"] = [r.token_ids for r in results]
    out[f"{tbo}/errors"] = [r.error for r in results]
    out[f"{tbo}/tbo_steps"] = runner.num_tbo_steps
    out["local_dp_ranks"] = runner.local_dp_ranks
    if tbo:
        out.update(serve_sampled(runner))
    return out, runner


def serve_sampled(runner) -> dict:
    """Sampled generation of ``prompts()`` with streaming, log-probabilities and a step log.

    Returns:
      ``{"sampled/tokens", "sampled/logprobs", "sampled/errors": per prompt,
      "sampled/streamed": [(prompt, token)] in on_token's order, "sampled/step_tokens":
      new tokens per logged step}``.
    """
    streamed, log = [], []
    results = runner.generate(
        prompts(), max_new_tokens=NEW_TOKENS, chunk_size=8, progress=False, logprobs=True,
        sampling_params=sampling.SamplingParams(temperature=0.8, top_p=0.9, seed=3),
        on_token=lambda index, token: streamed.append((index, token)), step_log=log,
    )  # fmt: skip
    return {
        "sampled/tokens": [r.token_ids for r in results],
        "sampled/logprobs": [r.logprobs for r in results],
        "sampled/errors": [r.error for r in results],
        "sampled/streamed": streamed,
        "sampled/step_tokens": [record.num_tokens for record in log],
    }


def _error_of(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as exc:  # recorded for the test to check
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def refusals(runner: runner_lib.ModelRunner) -> dict:
    """Batches refused on process 1 only, and a set-up mismatch: every process must raise.

    Args:
      runner: a TBO-off runner from ``serve`` (its compiled extend step is reused).

    Returns:
      ``{case: "<ExceptionType>: message"}`` as seen by this process, and (``"after"``) the
      logits of a valid step run after the refusals (the runner keeps working).
    """
    me = jax.process_index()
    rank = helpers.Rank()
    ok = rank.extend({0: [1, 2, 3]})
    local = len(runner.local_dp_ranks)
    cases = dict(
        count=[ok] * (local if me == 0 else local - 1),
        vocabulary=[helpers.Rank().extend({0: [1, 2, 500]}) if me == 1 else None] * local,
        bucket=[helpers.Rank().extend({0: list(range(40))}) if me == 1 else None] * local,
    )
    out = {name: _error_of(lambda b=b: runner.forward(b)) for name, b in cases.items()}
    other = make_runner(False, buckets=BUCKETS if me == 0 else (16, 32))
    out["setup"] = _error_of(lambda: other.forward([None] * local))
    out["after"] = runner.forward([ok] + [None] * (local - 1))[0]
    return out


def run(num_processes: int) -> dict:
    """The whole scenario as one of ``num_processes`` processes: ``serve`` with TBO off and
    on, then (with several processes) the refusals and the "auto" runner.

    Returns:
      Every result, keyed as ``serve``, ``refusals`` and ``serve_auto`` key them.
    """
    results, plain = serve(False)
    results.update(serve(True)[0])
    if num_processes > 1:
        results["refusals"] = refusals(plain)
        results.update(serve_auto())
    return results
