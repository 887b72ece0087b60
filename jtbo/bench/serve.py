"""``python -m jtbo.bench serve``: what users run, ``ModelRunner.generate`` end to end.

The model is a ``MoEConfig`` preset with random weights (``--preset``, by default
``deepseek_v3_reduced``, the model of ``bench tbo``), a Hugging Face ``config.json``
(``--hf-config``: jtbo maps it to a ``MoEConfig`` and draws random weights; ``--num-layers``
keeps only the first N layers, e.g. 8 of Qwen3-30B-A3B's 48) or a Hugging Face model directory
(``--model``). ``--prompts`` random prompts of ``--prompt-len`` token ids each (numpy,
``--seed``) are served by one ``ModelRunner`` (``--pool`` KV slots and ``--rows`` request rows
per DP rank, ``--tbo``, ``--devices`` DP ranks of one device each), greedy (or sampled on the
devices with ``--temperature`` / ``--top-p``, seeded by ``--seed``), for
``--max-new-tokens`` tokens each. Everything below is measured in one run, so the ratios
compare like with like:

1. One ``generate`` call compiles (warm-up), then ``--iters`` timed calls serve the same
   prompts (generate frees its requests' rows and slots at the end, so every call starts
   from the same state). Each call logs its steps (``generate(step_log=...)``: a
   ``StepRecord`` per step with its kind, tokens, sequences, host seconds and wall seconds).
   From the timed calls' records: prefill tokens/s (extend tokens over extend wall seconds),
   decode tokens/s likewise, the median decode-step wall and host time, and the number of
   steps of each kind; from the calls themselves: the median generate wall and output
   tokens/s (every generated token over that wall).
2. The device time of the same decode batch: the prompts split over the DP ranks round
   robin, as ``generate`` splits them, each sequence at context ``L + T // 2`` (the middle of
   the decode phase), in the runner's own KV pool after the generate timings (``bench tbo``'s
   synthetic decode batch and context), planned as the runner plans it (with ``--tbo auto``
   in the mode the runner chose for that shape). Its greedy token program is enqueued back
   to back (``bench tbo``'s ``back_to_back_ms``: ``ModelRunner.run_token_plan``; median of
   three runs): the devices' time per step, the host's hidden under it. The ratio
   decode-step wall inside ``generate`` / that device step is what serving adds around the step. For
   comparison, the synchronous ``run_plan`` of the same plan (logits back, EP counts read
   before the next) is timed too, with its host part (inputs and dispatch).
3. ``--peer transformers`` (needs ``torch`` and ``transformers``): the same checkpoint
   directory (``--model``, or for ``--hf-config`` the model transformers builds from that
   config with random weights, seed ``--seed``, saved as safetensors and loaded by jtbo
   too, so both serve identical weights) is loaded by
   ``AutoModelForCausalLM.from_pretrained`` (``--dtype``, on CUDA when there is one; the
   ``grouped_mm`` experts implementation where this transformers accepts one) and times
   ``model.generate`` on the same prompts as one batch (greedy, exactly ``T`` new tokens),
   and its prefill alone (``max_new_tokens=1``), one warm-up and ``--iters`` timed runs
   each. This runs first, in a child process of its own (spawned, so it shares nothing with
   jtbo's process: torch's CUDA context, allocator and threads end with it), so each library
   has the GPU and a process to itself. Printed: the
   speed ratios (transformers wall over jtbo's) and greedy-token agreement (random bf16
   weights may diverge after a few tokens: the first token, every token, whole prompts).

The table comes last, under a title line naming the model, its dimensions, the workload, the
pool, rows and TBO mode; ``--json`` prints the results as one JSON object after it.
"""

import argparse
import dataclasses
import gc
import importlib
import inspect
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo.bench import hf_configs
from jtbo.bench import tbo as tbo_bench
from jtbo.collectives import mesh as mesh_lib
from jtbo.core import arith, cli_arguments
from jtbo.models import config as config_lib
from jtbo.models import hf
from jtbo.models import model as model_lib
from jtbo.runner import admission, planning, sampling, tbo_auto, tbo_options
from jtbo.runner import generate as generate_lib
from jtbo.runner import runner as runner_lib

CONFIGURES_JAX = True  # main may set the CPU device count before the backend starts

PRESETS = {
    "deepseek_v3_reduced": config_lib.MoEConfig.deepseek_v3_reduced,
    "deepseek_v3_gqa_reduced": config_lib.MoEConfig.deepseek_v3_gqa_reduced,
    "tiny": config_lib.MoEConfig.tiny,
    "tiny_mla": config_lib.MoEConfig.tiny_mla,
}
"""``--preset`` names: the ``MoEConfig`` presets of ``bench tbo``."""
DEFAULT_PRESET = "deepseek_v3_reduced"
TBO_CHOICES = {"on": True, "off": False, "auto": "auto"}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
STEP_KINDS = ("extend", "decode", "mixed")
"""``StepRecord.kind`` values, in the order the table counts them."""
DEVICE_ITERS = 10
"""Timed ``run_plan`` calls of the device decode step (after two warm-ups)."""
PEER_MODULES = ("torch", "transformers")
EXIT_NO_PEER = 2
"""Exit status of ``--peer transformers`` where torch or transformers cannot be imported."""
DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jtbo.bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arguments(parser)
    parser.add_argument(
        "--prompts", type=cli_arguments.positive_int, default=64, help="random prompts served"
    )
    parser.add_argument("--prompt-len", type=cli_arguments.positive_int, default=512, metavar="L")
    parser.add_argument(
        "--max-new-tokens", type=cli_arguments.positive_int, default=32, metavar="T"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts and random weights")
    _add_runner_arguments(parser)
    parser.add_argument(
        "--iters", type=cli_arguments.positive_int, default=2, help="timed runs after a warm-up"
    )
    parser.add_argument(
        "--peer",
        choices=("none", "transformers"),
        default="none",
        help="also time transformers' generate on the same checkpoint",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON last")
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help=f"a MoEConfig preset, random weights (default: {DEFAULT_PRESET})",
    )
    source.add_argument(
        "--hf-config",
        type=cli_arguments.existing_file,
        metavar="FILE",
        help="a Hugging Face config.json: jtbo maps it, random weights",
    )
    source.add_argument("--model", type=Path, metavar="DIR", help="a Hugging Face model directory")
    parser.add_argument(
        "--num-layers",
        type=cli_arguments.positive_int,
        metavar="N",
        help="keep the first N layers of --hf-config",
    )


def _add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pool",
        type=cli_arguments.positive_int,
        metavar="SLOTS",
        help="KV slots per DP rank (default: ceil(prompts / devices) x (L + T))",
    )
    parser.add_argument(
        "--rows", type=cli_arguments.positive_int, help="max_running_requests (default: --prompts)"
    )
    parser.add_argument(
        "--max-context-len",
        type=cli_arguments.positive_int,
        help="ModelRunner(max_context_len=...) (default: the runner's)",
    )
    parser.add_argument(
        "--chunk-size",
        type=cli_arguments.positive_int,
        help="prompt tokens a rank prefills per step (default: generate's)",
    )
    parser.add_argument(
        "--pipeline",
        type=cli_arguments.non_negative_int,
        metavar="DEPTH",
        help="generate(pipeline=DEPTH): steps in flight while the host plans (default: generate's)",
    )
    parser.add_argument(
        "--mixed-chunk",
        action="store_true",
        help="generate(mixed_chunk=True): prompt chunks and decodes share MIXED steps",
    )
    parser.add_argument(
        "--temperature",
        type=cli_arguments.non_negative_float,
        default=0.0,
        help="jtbo samples with this temperature (0: greedy) and --top-p, seeded by --seed",
    )
    parser.add_argument(
        "--top-p", type=cli_arguments.probability, default=1.0, help="nucleus mass, in (0, 1]"
    )
    parser.add_argument("--tbo", choices=sorted(TBO_CHOICES), default="off", help="TBO mode")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--expert-dtype",
        choices=("bfloat16", "float8_e4m3fn"),
        help="routed experts' weights: block-scaled FP8 (float8_e4m3fn; from_pretrained("
        "expert_dtype=...)) or as the other weights (the default; bfloat16 with --dtype bfloat16)",
    )
    parser.add_argument(
        "--devices",
        type=cli_arguments.positive_int,
        default=1,
        help="DP ranks, one device each (dp=N, attn_tp=1; CPU: virtual devices)",
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    """The flags, checked together (``parser.error``: exit status 2 with the reason)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num_layers is not None and args.hf_config is None:
        parser.error("--num-layers applies to --hf-config only")
    if args.peer == "transformers" and args.hf_config is None and args.model is None:
        parser.error("--peer transformers needs a checkpoint: --hf-config or --model")
    if args.peer == "transformers" and args.temperature:
        parser.error("--peer transformers compares greedy tokens: leave --temperature at 0")
    try:
        args.sampling = sampling.SamplingParams(args.temperature, args.top_p, args.seed)
        config_lib.resolve_expert_dtype(args.expert_dtype, args.dtype)
    except ValueError as error:
        parser.error(str(error))
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json (not a Hugging Face model directory)")
    if args.hf_config is None and args.model is None and args.preset is None:
        args.preset = DEFAULT_PRESET
    try:
        args.raw = (
            None
            if args.hf_config is None
            else hf_configs.read_layers(args.hf_config, args.num_layers)
        )
        args.config = _moe_config(args.preset, args.raw, args.model)
        args.name = args.preset or f"{args.hf_config or args.model} ({_model_type(args)})"
    except (ValueError, OSError) as error:
        parser.error(f"{args.hf_config or args.model}: {error}")
    return args


def configure_environment(args: argparse.Namespace, environ) -> None:
    """Sets what must be in place before the JAX backend starts.

    Args:
      args: the parsed flags (``--devices``).
      environ: the environment to change (``os.environ`` in ``main``).
    """
    environ.setdefault(*tbo_bench.NVLS_ENVIRONMENT)  # NVLink multicast off
    flags = environ.get("XLA_FLAGS", "")
    if args.devices > 1 and DEVICE_COUNT_FLAG not in flags:  # only the host platform reads it
        environ["XLA_FLAGS"] = f"{flags} --{DEVICE_COUNT_FLAG}={args.devices}".strip()


def _require_peer_modules() -> None:
    """Exits with ``EXIT_NO_PEER`` and names the module when torch or transformers is missing."""
    for name in PEER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as error:
            print(f"--peer transformers needs the `{name}` module, which cannot be imported "
                  f"({error}): pip install torch transformers", file=sys.stderr)  # fmt: skip
            raise SystemExit(EXIT_NO_PEER) from error


def _moe_config(preset: str | None, raw: dict | None, directory: Path | None):
    """The served model's ``MoEConfig``: a preset's, ``raw``'s or the directory's config.json's.

    Raises:
      ValueError: an unsupported config (``families``).
    """
    if preset is not None:
        return PRESETS[preset]()
    if raw is None:
        raw = json.loads((directory / "config.json").read_text())
    return hf_configs.moe_config(raw)


def _model_type(args) -> str:
    """``model_type`` of the ``--hf-config`` or ``--model`` config.json."""
    raw = args.raw or json.loads((args.model / "config.json").read_text())
    return str(raw.get("model_type"))


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> np.ndarray:
    """``count`` prompts of ``length`` token ids drawn uniformly from ``[0, vocab_size)``.

    Args:
      count: prompts.
      length: tokens per prompt.
      vocab_size: the model's vocabulary.
      seed: numpy seed.

    Returns:
      ``[count, length]`` int32.
    """
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(count, length), dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What the timed ``generate`` calls measured (``step_stats``); None: no such step."""

    generate_s: float  # median wall seconds of one call
    output_tokens_per_s: float  # every generated token over that wall
    prefill_tokens_per_s: float | None  # extend tokens / extend wall seconds
    decode_tokens_per_s: float | None  # decode tokens / decode wall seconds
    decode_step_ms: float | None  # median wall of a decode step
    decode_host_ms: float | None  # median host time (plan and dispatch) of a decode step
    steps: dict[str, int]  # steps of each kind in one call
    peak_running: int  # the most sequences of one step (all ranks)


def _rate(records, kind: str) -> float | None:
    """Tokens per second of the steps of one kind: their tokens over their wall seconds."""
    chosen = [r for r in records if r.kind == kind]
    seconds = sum(r.wall_s for r in chosen)
    return sum(r.num_tokens for r in chosen) / seconds if chosen and seconds > 0 else None


def _median_ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1e3 if values else None


def step_stats(walls: list[float], logs: list[list], output_tokens: int) -> StepStats:
    """Summarizes the timed ``generate`` calls.

    Args:
      walls: each call's wall seconds.
      logs: each call's ``StepRecord`` list (``generate(step_log=...)``).
      output_tokens: tokens one call generated.

    Returns:
      The ``StepStats``: rates and medians over every call's steps, step counts of the first.
    """
    records = [record for log in logs for record in log]
    decode = [r for r in records if r.kind == "decode"]
    wall = statistics.median(walls)
    return StepStats(
        generate_s=wall, output_tokens_per_s=output_tokens / wall,
        prefill_tokens_per_s=_rate(records, "extend"), decode_tokens_per_s=_rate(records, "decode"),
        decode_step_ms=_median_ms([r.wall_s for r in decode]),
        decode_host_ms=_median_ms([r.host_s for r in decode]),
        steps={kind: sum(r.kind == kind for r in logs[0]) for kind in STEP_KINDS},
        peak_running=max((r.num_seqs for r in records), default=0),
    )  # fmt: skip


def agreement(got: np.ndarray, want: np.ndarray) -> tuple[float, float, float]:
    """Greedy-token agreement of two ``[prompts, tokens]`` continuations of the same prompts.

    Args:
      got: one library's generated token ids.
      want: the other's.

    Returns:
      The share of prompts whose first token agrees, of (prompt, position) tokens that agree,
      and of prompts whose whole continuation agrees.
    """
    same = np.asarray(got) == np.asarray(want)
    return float(same[:, 0].mean()), float(same.mean()), float(same.all(axis=1).mean())


@dataclasses.dataclass(frozen=True)
class PeerRun:
    """What ``--peer transformers`` measured."""

    generate_s: float  # median wall of one batched generate of T tokens
    prefill_s: float  # median wall of a generate of one token (the prefill)
    tokens: np.ndarray  # [prompts, T] its greedy tokens
    experts: str  # the experts implementation that ran
    device: str  # "cuda" or "cpu"


def _write_peer_checkpoint(raw: dict, directory: Path, dtype: str, seed: int) -> None:
    """transformers' model of ``raw`` with random weights (seed ``seed``; drawn on the GPU
    where there is one), saved (safetensors)."""
    torch, transformers = (importlib.import_module(name) for name in PEER_MODULES)
    fields = dict(raw)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # drawn where it runs
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(directory)
    del model
    gc.collect()


def _experts_kwargs(transformers) -> dict:
    """``experts_implementation="grouped_mm"`` where this transformers has that setting."""
    setter = getattr(transformers.PreTrainedModel, "set_experts_implementation", None)
    loader = inspect.signature(transformers.PreTrainedModel.from_pretrained).parameters
    if "experts_implementation" in loader or (
        setter is not None and "experts_implementation" in inspect.signature(setter).parameters
    ):
        return {"experts_implementation": "grouped_mm"}
    return {}


def _peer_timed(torch, model, ids, new_tokens: int, iters: int):
    """Median seconds of ``iters`` batched greedy generates of exactly ``new_tokens`` tokens
    (after one warm-up), and the last one's output ids."""
    config = model.config
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    pad = next((t for t in (config.pad_token_id, eos) if t is not None), 0)
    cuda = ids.is_cuda

    def once():
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
            )  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    once()
    runs = [once() for _ in range(iters)]
    return statistics.median(seconds for seconds, _ in runs), runs[-1][1]


def _peer_run(directory: Path, prompts: np.ndarray, args) -> PeerRun:
    """Times transformers on ``directory`` (see the module docstring), then frees its GPU
    memory for jtbo."""
    torch, transformers = (importlib.import_module(name) for name in PEER_MODULES)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=getattr(torch, args.dtype), **_experts_kwargs(transformers)
    ).to(device)
    model.eval()
    experts = str(getattr(model.config, "_experts_implementation", None) or "default")
    ids = torch.as_tensor(prompts, dtype=torch.long, device=device)
    generate_s, out = _peer_timed(torch, model, ids, args.max_new_tokens, args.iters)
    prefill_s, _ = _peer_timed(torch, model, ids, 1, args.iters)
    tokens = out[:, prompts.shape[1] :].cpu().numpy()
    del model, out
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return PeerRun(generate_s, prefill_s, tokens, experts, device)


def _peer_checkpoint_and_run(directory: Path, prompts: np.ndarray, args) -> PeerRun:
    """The peer's part of the run: for ``--hf-config``, its random checkpoint first."""
    if args.hf_config is not None:
        _write_peer_checkpoint(args.raw, directory, args.dtype, args.seed)
    return _peer_run(directory, prompts, args)


def _peer_in_child(directory: Path, prompts: np.ndarray, args) -> PeerRun:
    """``_peer_checkpoint_and_run`` in a child process (started fresh, "spawn"): torch's CUDA
    context, allocator and threads end with it, so jtbo's timings run in a process that
    never held them."""
    context = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_peer_checkpoint_and_run, directory, prompts, args).result()


def _pool(args) -> int:
    """``--pool``, or enough KV slots for a DP rank's share of the prompts."""
    per_rank = arith.ceil_div(args.prompts, args.devices)
    return args.pool or per_rank * (args.prompt_len + args.max_new_tokens)


def _runner(args, mesh, directory: Path | None) -> runner_lib.ModelRunner:
    """The served model (random weights of ``args.config``, or loaded from ``directory``)
    in a ``ModelRunner`` sized by the flags."""
    dtype = DTYPES[args.dtype]
    if directory is None:
        stored = config_lib.resolve_expert_dtype(args.expert_dtype, args.dtype)
        config = dataclasses.replace(args.config, expert_dtype=stored)
        model = model_lib.MoEModel(config, rngs=nnx.Rngs(args.seed))
    else:
        model = hf.from_pretrained(
            directory, dtype=dtype, mesh=mesh, expert_dtype=args.expert_dtype
        )
    extra = {} if args.max_context_len is None else {"max_context_len": args.max_context_len}
    return runner_lib.ModelRunner(
        model, mesh, max_total_tokens=_pool(args), max_running_requests=args.rows or args.prompts,
        tbo=tbo_options.TboOptions(enable_two_batch_overlap=TBO_CHOICES[args.tbo]), dtype=dtype,
        **extra,
    )  # fmt: skip


def _time_generate(runner, prompts: np.ndarray, args) -> tuple[list[float], list[list], list]:
    """One warm-up ``generate`` and ``--iters`` timed ones of the same prompts.

    Returns:
      ``(wall seconds per timed call, step records per timed call, the last call's results)``.

    Raises:
      ValueError: a prompt was rejected (the pool or the context too small).
    """
    kwargs = dict(
        max_new_tokens=args.max_new_tokens, progress=False, sampling_params=args.sampling,
        mixed_chunk=args.mixed_chunk,
    )  # fmt: skip
    if args.chunk_size is not None:
        kwargs["chunk_size"] = args.chunk_size
    kwargs["pipeline"] = _pipeline(args)
    walls, logs = [], []
    for call in range(args.iters + 1):
        records = []
        start = time.perf_counter()
        results = runner.generate(list(prompts), step_log=records, **kwargs)
        if call:  # the first call compiles
            walls.append(time.perf_counter() - start)
            logs.append(records)
        rejected = [(i, r.error) for i, r in enumerate(results) if r.error]
        if rejected:
            raise ValueError(f"{len(rejected)} prompts rejected, the first: {rejected[0]}")
    return walls, logs, results


def _decode_batches(runner, prompts: int, context: int):
    """Per DP rank the decode batch ``generate`` would run at ``context``: its round-robin share
    of the prompts, at most its running limit (``bench tbo``'s synthetic batch), or an idle
    batch; or ``(None, why)`` where the runner cannot hold them."""
    config = runner.runner_config
    dp = config.dp_size
    limit = admission.running_limit(config.max_running_requests, config.plan.token_buckets)
    counts = [min(len(range(rank, prompts, dp)), limit) for rank in range(dp)]
    needed = max(counts) * context
    if needed > config.max_total_tokens or context > config.max_context_len:
        return None, (
            f"{max(counts)} sequences of context {context} need {needed} slots and context "
            f"{context}; the runner has {config.max_total_tokens} and {config.max_context_len}"
        )
    vocab = config.model.vocab_size
    return tuple(
        tbo_bench.decode_batch(n, context, vocab) if n else planning.idle_batch() for n in counts
    ), None


def _decode_plan(runner, batches) -> planning.StepPlan:
    """The runner's plan of ``batches`` (recorded, with their cached context), in the TBO mode
    it would run them in (``--tbo auto``: its choice for that shape, where it made one)."""
    for rank, batch in enumerate(batches):
        if batch.batch_size and batch.seq_lens[0] > 1:
            runner.record(rank, tbo_bench.decode_prefix(batch))
        if batch.batch_size:
            runner.record(rank, batch)
    plan = planning.plan_step(list(batches), runner.runner_config.plan, logits="last")
    chosen = {d.shape: d.use_tbo for d in runner.tbo_decisions()}
    if plan.child_capacity is not None and not chosen.get(
        tbo_auto.TboShape(plan.capacity, plan.mode), True
    ):
        plain = dataclasses.replace(runner.runner_config.plan, enable_tbo=False)
        plan = planning.plan_step(list(batches), plain, logits="last")
    return plan


@dataclasses.dataclass(frozen=True)
class DeviceStep:
    """The decode step of the same batch outside ``generate`` (``_device_step``), medians."""

    step_ms: float  # the token program enqueued back to back: the devices' time per step
    run_plan_ms: float  # one synchronous run_plan (logits) until its logits are ready
    host_ms: float  # of run_plan on the host before the devices run: inputs + dispatch


def _device_step(runner, args) -> tuple[DeviceStep | None, str | None]:
    """The decode step in the middle of the decode phase, run alone, or ``(None, why not)``."""
    context = args.prompt_len + args.max_new_tokens // 2
    batches, why = _decode_batches(runner, args.prompts, context)
    if batches is None:
        return None, why
    plan = _decode_plan(runner, batches)
    times, [(phases, _)] = tbo_bench.time_interleaved([(runner, plan)], DEVICE_ITERS)
    host = (phases.inputs + phases.dispatch) * 1e3
    return DeviceStep(tbo_bench.back_to_back_ms(runner, plan), times[0] * 1e3, host), None


def _tokens(results) -> np.ndarray:
    return np.asarray([result.token_ids for result in results], np.int32)


def _cell(value, digits: int | None = None) -> str:
    """A table cell: "-" for None; a float with ``digits`` decimals, else one decimal from 100
    up and three significant digits below."""
    if not isinstance(value, float):
        return "-" if value is None else str(value)
    if digits is not None:
        return f"{value:.{digits}f}"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"


def _pipeline(args) -> bool | int:
    """``generate``'s ``pipeline`` argument: ``--pipeline``, else its default."""
    return True if args.pipeline is None else args.pipeline


def _title(args, runner) -> str:
    """The line above the table: model, dimensions, workload, pool, rows, TBO, devices."""
    c, rc = args.config, runner.runner_config
    device = jax.devices()[0]
    return (
        f"serve: {args.name}: hidden {c.hidden_size}, {c.num_layers} layers, "
        f"{c.num_experts} experts top-{c.num_experts_per_tok}, {c.attention_kind} attention, "
        f"vocab {c.vocab_size}; "
        f"{args.prompts} prompts x {args.prompt_len} tokens + {args.max_new_tokens} new; pool "
        f"{rc.max_total_tokens} slots/rank, rows {rc.max_running_requests}, max context "
        f"{rc.max_context_len}; TBO {args.tbo}; dp {rc.dp_size} x {device.device_kind}; "
        f"{args.dtype}; pipeline {generate_lib.pipeline_depth(_pipeline(args))}"
        f"{', mixed chunk' if args.mixed_chunk else ''}; "
        + (
            "greedy"
            if args.sampling.greedy
            else f"sampled (temperature {args.temperature}, top-p {args.top_p})"
        )
    )


def _rows(stats: StepStats, device: DeviceStep | None) -> list[tuple[str, object]]:
    """The jtbo column of the table: (measure, value)."""
    wall = stats.decode_step_ms
    return [
        ("generate wall (s)", stats.generate_s),
        ("output tokens/s", stats.output_tokens_per_s),
        ("prefill tokens/s", stats.prefill_tokens_per_s),
        ("decode tokens/s", stats.decode_tokens_per_s),
        ("decode step wall (ms, median)", wall),
        ("decode step host (ms, median)", stats.decode_host_ms),
        ("device decode step, back to back (ms, median)", device and device.step_ms),
        ("run_plan decode step, synchronous (ms, median)", device and device.run_plan_ms),
        ("run_plan's host part: inputs + dispatch (ms)", device and device.host_ms),
        (
            "decode step wall / device step",
            None if None in (device, wall) else wall / device.step_ms,
        ),
        ("steps extend / decode / mixed", " / ".join(str(stats.steps[k]) for k in STEP_KINDS)),
        ("peak running sequences", stats.peak_running),
    ]


def peer_summary(peer: PeerRun, stats: StepStats, prompts: int, prompt_len: int, tokens) -> dict:
    """transformers' figures beside jtbo's.

    Args:
      peer: what ``--peer transformers`` measured.
      stats: jtbo's ``step_stats``.
      prompts: prompts served.
      prompt_len: tokens per prompt.
      tokens: ``[prompts, T]`` jtbo's generated tokens.

    Returns:
      Its rates, the speed ratios (transformers wall over jtbo's, prefill likewise) and the
      greedy agreement (``agreement``), by name.
    """
    first, every, whole = agreement(tokens, peer.tokens)
    prefill_rate = prompts * prompt_len / peer.prefill_s
    jtbo_prefill = stats.prefill_tokens_per_s
    return dict(
        device=peer.device, experts=peer.experts, generate_s=peer.generate_s,
        output_tokens_per_s=tokens.size / peer.generate_s, prefill_s=peer.prefill_s,
        prefill_tokens_per_s=prefill_rate, generate_speedup=peer.generate_s / stats.generate_s,
        prefill_speedup=None if jtbo_prefill is None else jtbo_prefill / prefill_rate,
        first_token_agreement=first, token_agreement=every, prompt_agreement=whole,
    )  # fmt: skip


def table(rows: list[tuple[str, object]], peer: dict | None) -> str:
    """The markdown table: jtbo's measures, and with a peer transformers' and the ratio.

    Args:
      rows: ``(measure, jtbo value)`` pairs (``_rows``).
      peer: ``peer_summary`` or None.

    Returns:
      The table's lines, joined.
    """
    if peer is None:
        lines = ["| measure | jtbo |", "|---|---|"]
        return "\n".join(lines + [f"| {name} | {_cell(value)} |" for name, value in rows])
    theirs = {
        "generate wall (s)": (peer["generate_s"], peer["generate_speedup"]),
        "output tokens/s": (peer["output_tokens_per_s"], peer["generate_speedup"]),
        "prefill tokens/s": (peer["prefill_tokens_per_s"], peer["prefill_speedup"]),
    }
    lines = ["| measure | jtbo | transformers | jtbo speed / transformers |", "|---|---|---|---|"]
    for name, value in rows:
        other, ratio = theirs.get(name, (None, None))
        lines.append(f"| {name} | {_cell(value)} | {_cell(other)} | {_cell(ratio, 3)} |")
    shares = (peer["first_token_agreement"], peer["token_agreement"], peer["prompt_agreement"])
    cells = " / ".join(f"{share:.3f}" for share in shares)
    lines.append(
        f"| greedy agreement: first token / all tokens / whole prompts | - | {cells} | - |"
    )
    return "\n".join(lines)


def _json(args, runner, stats: StepStats, device: DeviceStep | None, peer: dict | None) -> str:
    """The results as one JSON object."""
    c, rc = args.config, runner.runner_config
    return json.dumps(dict(
        model=dict(source=args.name,
                   hidden_size=c.hidden_size, num_layers=c.num_layers,
                   num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   attention_kind=c.attention_kind, vocab_size=c.vocab_size),
        prompts=args.prompts, prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens,
        pool=rc.max_total_tokens, rows=rc.max_running_requests,
        max_context_len=rc.max_context_len, dp=rc.dp_size, tbo=args.tbo,
        dtype=args.dtype, expert_dtype=args.expert_dtype or args.dtype, iters=args.iters,
        jtbo=dataclasses.asdict(stats),
        device_step=device and dataclasses.asdict(device), transformers=peer,
    ))  # fmt: skip


def _serve(args, scratch: Path) -> None:
    """Runs the measurements in order (peer, generate, device step) and prints the results."""
    prompts = random_prompts(args.prompts, args.prompt_len, args.config.vocab_size, args.seed)
    directory = args.model
    if args.peer == "transformers" and args.hf_config is not None:
        directory = scratch
    peer = None if args.peer == "none" else _peer_in_child(directory, prompts, args)
    runner = _runner(args, mesh_lib.make_mesh(args.devices, 1), directory)
    walls, logs, results = _time_generate(runner, prompts, args)
    tokens = _tokens(results)
    stats = step_stats(walls, logs, tokens.size)
    print(runner.tbo_summary())  # the generate calls' steps, before the device-step runs
    device, why = _device_step(runner, args)
    if why is not None:
        print(f"device decode step: not timed ({why})")
    summary = None
    if peer is not None:
        summary = peer_summary(peer, stats, args.prompts, args.prompt_len, tokens)
        print(f"transformers on {peer.device}, experts implementation {peer.experts}")
    print(_title(args, runner))
    print(table(_rows(stats, device), summary))
    if args.json:
        print(_json(args, runner, stats, device, summary))


def main(argv: list[str]) -> None:
    """Runs the benchmark and prints its table (see the module docstring).

    Args:
      argv: the flags (``--help`` lists them).

    Raises:
      SystemExit: bad flags (status 2, argparse's message), or ``--peer transformers`` where
        torch or transformers cannot be imported (``EXIT_NO_PEER``, naming the module).
      ValueError: a prompt the runner rejected (a ``--pool`` or ``--max-context-len`` too small).
    """
    args = _parse(argv)
    configure_environment(args, os.environ)  # before anything starts the backend
    if args.peer == "transformers":
        _require_peer_modules()
    with tempfile.TemporaryDirectory(prefix="jtbo_serve_") as scratch:
        _serve(args, Path(scratch))
