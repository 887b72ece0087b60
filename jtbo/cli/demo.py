"""``python -m jtbo.demo``: serve random prompts with TBO off, on and "auto" and compare.

On a CPU it uses 8 virtual devices (dp=4, attn_tp=2 unless flags say otherwise); on GPUs, all
of them. It builds ``MoEConfig.tiny()`` with random weights, runs ``generate`` over a few dozen
random prompts with two-batch overlap off, on and "auto" (TBO per step shape where it was
measured to pay), and prints tokens generated, steps (and how many ran TBO, and for "auto"
why: ``ModelRunner.tbo_summary``), compile counts, tokens/s, the max |logits difference| of
one shared step (each rank prefills one prompt) between TBO and plain, each run's max
|logits error| on that step against the float64 reference forward (``jtbo.models.reference``:
one device, dense attention, every expert on every token), whether the generated tokens
match, and — with the ``aot`` extra — the overlap coverage of the model's prefill and decode
steps compiled for 8 H200s. Exit code 1 if the runs disagree, or on the CPU if a run is
further than ``REFERENCE_TOLERANCE`` from the reference (GPUs run float32 dots in TF32, so
there the error is printed, not judged): a check that a layout (``--dp``, ``--attn-tp``,
``--moe-a2a-backend``) computes the model exactly.

Its first line is ``jtbo.info.summary_line()``, the next the platform jax runs on. With
``--expect-gpu`` (or ``JTBO_EXPECT_GPU=1``, which ``make demo`` sets where it installed the GPU
set-up) a run that finds jax on another platform says so on stderr and exits 3 without
running: it presents no CPU figures as GPU ones.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo import aot, info, split
from jtbo.analysis import aot_report
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import layer_ops, reference
from jtbo.models import model as model_lib
from jtbo.runner import runner as runner_lib
from jtbo.runner import tbo_options

TOLERANCE = 1e-3  # max |logits difference| allowed between TBO and plain (float32)
REFERENCE_TOLERANCE = 1e-3  # max |logits error| against the float64 reference (IEEE float32)
EXIT_NOT_ON_GPU = 3  # exit code: a GPU was expected but jax runs elsewhere


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jtbo.demo", description=__doc__)
    parser.add_argument("--dp", type=int, default=None, help="DP ranks (default: devices / tp)")
    parser.add_argument("--attn-tp", type=int, default=None, help="devices per DP rank")
    parser.add_argument("--prompts", type=int, default=32, help="number of random prompts")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--moe-a2a-backend", choices=("ep", "none"), default="ep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--expect-gpu", action="store_true", default=os.environ.get("JTBO_EXPECT_GPU") == "1",
        help="refuse to run unless jax runs on a GPU (default: env JTBO_EXPECT_GPU=1)",
    )  # fmt: skip
    return parser


def _platform_check(expect_gpu: bool) -> int | None:
    """Prints the platform; returns ``EXIT_NOT_ON_GPU`` when a GPU was expected but is absent.

    Args:
      expect_gpu: whether a GPU was asked for (``--expect-gpu`` / ``JTBO_EXPECT_GPU=1``).

    Returns:
      None to go on, or the exit code to stop with.
    """
    platform = jax.default_backend()
    print(f"platform: {platform} ({jax.devices()[0].device_kind})")
    if not expect_gpu or platform == "gpu":
        return None
    print(
        f"\n*** GPU EXPECTED, BUT JAX RUNS ON {platform.upper()} ***\n"
        "The GPU set-up was installed or asked for (make demo GPU=1 / JTBO_EXPECT_GPU=1 / "
        "--expect-gpu), but jax found no GPU: check `python -m jtbo.info` (CUDA plugin version, "
        "JAX_PLATFORMS, drivers). Refusing to present CPU figures as GPU figures.",
        file=sys.stderr,
    )
    return EXIT_NOT_ON_GPU


def _layout(args) -> tuple[int, int]:
    count = len(jax.devices())
    tp = args.attn_tp or (2 if count % 2 == 0 and count > 1 else 1)
    return (args.dp or count // tp), tp


def _serve(model, mesh, tbo: bool | str, prompts, args):
    runner = runner_lib.ModelRunner(
        model, mesh, moe=layer_ops.MoEOptions(moe_a2a_backend=args.moe_a2a_backend),
        tbo=tbo_options.TboOptions(enable_two_batch_overlap=tbo), max_total_tokens=256,
        max_running_requests=8, token_buckets=(8, 16, 32, 64), dtype=jnp.float32,
    )  # fmt: skip
    start = time.perf_counter()
    results = runner.generate(prompts, max_new_tokens=args.max_new_tokens, chunk_size=16)
    seconds = time.perf_counter() - start
    return runner, results, seconds


def _shared_step_logits(runner, prompts) -> list:
    """Logits of one EXTEND step (each rank prefills one prompt) on a drained runner."""
    batches = []
    for rank in range(runner.dp_size):
        ids = np.asarray(prompts[rank % len(prompts)], np.int32)
        n = len(ids)
        batches.append(
            split.ForwardBatch(
                forward_mode=split.ForwardMode.EXTEND,
                batch_size=1,
                input_ids=ids,
                positions=np.arange(n),
                out_cache_loc=np.arange(1, n + 1),
                req_pool_indices=[0],
                seq_lens=[n],
                extend_seq_lens=[n],
                extend_prefix_lens=[0],
            )  # fmt: skip
        )
    return runner.forward(batches)


def _reference_error(model, prompts, logits) -> float:
    """Max |logits error| of ``_shared_step_logits``' step against the float64 reference.

    The reference (``jtbo.models.reference``) runs the same weights in float64 on one device:
    dense attention over each whole prompt, every expert on every token, nothing sharded,
    padded, split or overlapped, so it shares none of the step's layout.

    Args:
      model: the served (float32) model.
      prompts: the prompts; rank ``r`` prefilled ``prompts[r % len(prompts)]``.
      logits: the step's per-rank logits ``[prompt length, vocab]``.

    Returns:
      The largest absolute difference over every rank, token and vocabulary entry.
    """
    with jax.enable_x64(True):
        wide = model_lib.cast(model, jnp.float64)
        want = [reference.reference_causal_logits(wide, prompts[r % len(prompts)])
                for r in range(len(logits))]  # fmt: skip
    return max(float(np.max(np.abs(got - w))) for got, w in zip(logits, want, strict=True))


def _coverage_lines(dp: int, tp: int) -> list[str]:
    if not aot.aot_available():
        return ["overlap coverage: skipped (install the `aot` extra, run with JAX_PLATFORMS=cpu)"]
    lines = []
    for mode in (split.ForwardMode.EXTEND, split.ForwardMode.DECODE):
        rep = aot_report.model_overlap_report(
            config_lib.MoEConfig.tiny(), dp_size=dp, attn_tp_size=tp, mode=mode,
            tokens_per_rank=64,
        )  # fmt: skip
        lines.append(f"overlap coverage ({mode.name}, {dp}x{tp} H200 compile): {rep.coverage:.3f}")
    return lines


def main(argv=None) -> int:
    """Runs the demo; returns the exit code (0: the runs agree (on the CPU also with the
    reference), 1: they do not, 3: no GPU as expected)."""
    args = _parser().parse_args(argv)
    print(info.summary_line())
    stop = _platform_check(args.expect_gpu)
    if stop is not None:
        return stop
    dp, tp = _layout(args)
    mesh = mesh_lib.make_mesh(dp, tp)
    config = config_lib.MoEConfig.tiny()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(args.seed))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, config.vocab_size, int(n)).tolist()
               for n in rng.integers(4, 40, args.prompts)]  # fmt: skip
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}; dp={dp}, attn_tp={tp}, "
          f"MoE {args.moe_a2a_backend}; {len(prompts)} prompts")  # fmt: skip
    runs = {}
    for tbo in (False, True, "auto"):
        runner, results, seconds = _serve(model, mesh, tbo, prompts, args)
        made = sum(len(r.token_ids) for r in results)
        label = {False: "off ", True: "on  ", "auto": "auto"}[tbo]
        print(f"TBO {label}: {made} tokens, {runner.num_steps} steps, {runner.compile_count} "
              f"compiles, {made / seconds:.1f} tokens/s (compiles and auto timing included)\n"
              f"  {runner.tbo_summary()}")  # fmt: skip
        runs[tbo] = (runner, results)
    logits = [_shared_step_logits(runs[tbo][0], prompts) for tbo in (False, True)]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(*logits, strict=True))
    errors = [_reference_error(model, prompts, out) for out in logits]
    tokens = {tbo: [r.token_ids for r in results] for tbo, (_, results) in runs.items()}
    same = tokens[False] == tokens[True] == tokens["auto"]
    print(f"max |logits difference| TBO vs plain: {diff:.3g} (tolerance {TOLERANCE})")
    # GPUs run float32 dots in TF32 (docs/benchmarks/, "Attention: the paged kernel"): their
    # error is shown, not judged.
    judged = jax.default_backend() == "cpu"
    bound = f"tolerance {REFERENCE_TOLERANCE}" if judged else "not judged: TF32 dots"
    print(f"max |logits error| vs the float64 reference: plain {errors[0]:.3g}, TBO "
          f"{errors[1]:.3g} ({bound})")  # fmt: skip
    print(f"generated tokens identical (off, on, auto): {same}")
    for line in _coverage_lines(dp, tp):
        print(line)
    exact = not judged or max(errors) <= REFERENCE_TOLERANCE
    return 0 if same and diff <= TOLERANCE and exact else 1


if __name__ == "__main__":
    sys.exit(main())
