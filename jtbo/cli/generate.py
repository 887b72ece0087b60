"""``python -m jtbo.generate``: serve a Hugging Face MoE checkpoint from the command line.

Loads ``--model DIR`` with ``jtbo.models.hf.from_pretrained`` straight onto a ``--dp`` x
``--attn-tp`` mesh, tokenizes the prompts (``--prompt``, repeatable, and ``--prompts-file``,
one prompt a line) with ``DIR/tokenizer.json`` (the ``tokenizers`` package: the ``hf``
extra), serves them as one batch through ``ModelRunner.generate`` (TBO ``on`` / ``off`` /
``auto``; greedy unless ``--temperature`` > 0) and streams the text: a single prompt's text
as its tokens arrive, several prompts each as one line when it is complete. Then it prints
the tokens generated, tokens/s (compiles included) and how many steps ran with two-batch
overlap (``ModelRunner.tbo_summary``).

Everything that can be checked before the weights load is checked first: the flags'
values, the prompts (none may be empty), the model directory's ``config.json`` and
``tokenizer.json``, the layout on this host's devices and the kernels asked for. Then the
first line on stderr names the devices, the layout and the kernels chosen. Errors are one
line on stderr: exit 2 for usage errors (a flag, a prompt, a missing file), 1 for errors
while loading or serving (``JTBO_TRACEBACK=1`` shows their traceback).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jtbo.attention import backend as attn_backend_lib
from jtbo.collectives import ep_config
from jtbo.collectives import mesh as mesh_lib
from jtbo.core import arith, cli_arguments
from jtbo.kernels import impls
from jtbo.models import hf, layer_ops
from jtbo.runner import runner as runner_lib
from jtbo.runner import runner_config, sampling, tbo_options

EXIT_USAGE = 2
EXIT_RUN_ERROR = 1
TRACEBACK_ENV = "JTBO_TRACEBACK"  # set to 1: errors while loading or serving keep their trace
TBO_CHOICES = {"on": True, "off": False, "auto": "auto"}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
# The kernel impl each attention backend runs (to say before loading whether it runs here).
_IMPL_OF_ATTENTION_BACKEND = {"native": "xla", "pallas": "pallas", "triton": "triton"}


class UsageError(Exception):
    """A flag, prompt or file that cannot serve a run here (exit 2); the message names it."""


def parser() -> argparse.ArgumentParser:
    """The command line (also used by ``jtbo/generate.py`` to size the CPU device count)."""
    p = cli_arguments.OneLineErrorParser(prog="python -m jtbo.generate", description=__doc__)
    p.add_argument(
        "--model",
        required=True,
        type=cli_arguments.existing_directory,
        help="Hugging Face model directory",
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument(
        "--prompts-file",
        type=cli_arguments.existing_file,
        help="a file with one prompt per line (blank lines are skipped)",
    )
    p.add_argument("--max-new-tokens", type=cli_arguments.positive_int, default=32)
    p.add_argument(
        "--dp",
        type=cli_arguments.positive_int,
        default=None,
        help="DP ranks (default: devices / attn-tp)",
    )
    p.add_argument(
        "--attn-tp", type=cli_arguments.positive_int, default=1, help="devices per DP rank"
    )
    p.add_argument("--tbo", choices=sorted(TBO_CHOICES), default="auto")
    p.add_argument("--moe-a2a-backend", choices=("ep", "none"), default="ep")
    p.add_argument(
        "--ep-exchange",
        choices=ep_config.EXCHANGES,
        default="dense",
        help="EP exchange (peer_copy: copy-engine peer copies, one process)",
    )
    p.add_argument(
        "--ep-routing-stats",
        type=cli_arguments.existing_file,
        help="EP capacities from this routing-statistics file (ModelRunner)",
    )
    p.add_argument(
        "--attention-backend",
        choices=tuple(attn_backend_lib.ATTENTION_BACKENDS),
        help="default: the fastest that serves the model here",
    )
    p.add_argument(
        "--dp-padding",
        choices=("auto", "max_len", "sum_len"),
        default="auto",
        help="DP gather layout of --moe-a2a-backend none",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument(
        "--temperature",
        type=cli_arguments.non_negative_float,
        default=0.0,
        help="0: greedy (default)",
    )
    p.add_argument("--top-p", type=cli_arguments.probability, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p


def _load_tokenizer(directory: Path):
    """``DIR/tokenizer.json`` read by the ``tokenizers`` package.

    Raises:
      UsageError: no ``tokenizers`` package, or no ``tokenizer.json``.
      ValueError: a ``tokenizer.json`` that does not read (naming the file).
    """
    try:
        import tokenizers  # noqa: PLC0415 - the optional `hf` extra
    except ImportError:
        raise UsageError(
            "python -m jtbo.generate needs the `tokenizers` package: pip install 'jtbo[hf]'"
        ) from None
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"--model {directory}: no tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{path}: {error}") from error


def _prompts(args) -> list[str]:
    """The prompts, in order: ``--prompt`` values, then ``--prompts-file``'s non-blank lines.

    Raises:
      UsageError: no prompt at all, or an empty ``--prompt``.
      ValueError: a prompts file that is not UTF-8 text (naming the file).
    """
    for number, text in enumerate(args.prompt, 1):
        if not text:
            raise UsageError(f"--prompt number {number} is empty: every prompt needs text")
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        try:
            lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as error:
            raise ValueError(f"{args.prompts_file}: not UTF-8 text ({error})") from None
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError("no prompt: pass --prompt TEXT or --prompts-file FILE with text")
    return prompts


class _Streamer:
    """Prints text as tokens arrive (see the module docstring)."""

    def __init__(self, tokenizer, prompts: list[str], max_new_tokens: int, out):
        self.tokenizer, self.prompts, self.out = tokenizer, prompts, out
        self.max_new_tokens = max_new_tokens
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.printed = ""  # single prompt: the text printed so far

    def __call__(self, index: int, token: int) -> None:
        self.tokens[index].append(token)
        if len(self.prompts) == 1:
            text = self.tokenizer.decode(self.tokens[0])
            self.out.write(text[len(self.printed) :] if text.startswith(self.printed) else text)
            self.printed = text
        elif len(self.tokens[index]) == self.max_new_tokens:
            text = self.tokenizer.decode(self.tokens[index])
            self.out.write(f"[{index}] {self.prompts[index]}{text}\n")
        self.out.flush()


def _mesh(args) -> jax.sharding.Mesh:
    """The ``--dp`` x ``--attn-tp`` mesh on this host's devices.

    Raises:
      UsageError: more devices asked for than the host has.
    """
    dp = args.dp or max(len(jax.devices()) // args.attn_tp, 1)
    try:
        return mesh_lib.make_mesh(dp, args.attn_tp)
    except mesh_lib.TooFewDevicesError as error:
        raise UsageError(
            f"--dp {dp} x --attn-tp {args.attn_tp} needs {error.needed} devices; this host has "
            f"{error.available} {jax.devices()[0].platform} device(s)"
        ) from None


def _check_attention_backend(name: str | None) -> None:
    """Refuses an ``--attention-backend`` whose kernels cannot run on this platform."""
    if name is None:
        return
    reason = impls.unavailable_reason(_IMPL_OF_ATTENTION_BACKEND[name], impls.backend())
    if reason is not None:
        raise UsageError(f"--attention-backend {name} cannot run here: {reason}")


def _options(args) -> tuple[layer_ops.MoEOptions, tbo_options.TboOptions]:
    """The runner's MoE and TBO options from the flags.

    Raises:
      UsageError: a combination the options refuse (the message names the field).
    """
    try:
        moe = layer_ops.MoEOptions(
            moe_a2a_backend=args.moe_a2a_backend, ep_exchange=args.ep_exchange
        )
        return moe, tbo_options.TboOptions(enable_two_batch_overlap=TBO_CHOICES[args.tbo])
    except ValueError as error:
        raise UsageError(f"--moe-a2a-backend / --ep-exchange / --tbo: {error}") from None


def _layout(args, config) -> tuple[jax.sharding.Mesh, layer_ops.ParallelConfig, tuple]:
    """The mesh, the resolved kernels and the options, checked against the model's config.

    Raises:
      UsageError: a layout or kernel that cannot serve the model here.
    """
    _check_attention_backend(args.attention_backend)
    mesh = _mesh(args)
    moe, tbo = _options(args)
    try:
        parallel = runner_config.parallel_config(config, mesh, moe, tbo, args.attention_backend)
    except ValueError as error:
        raise UsageError(f"--dp {mesh.shape['dp']} x --attn-tp {args.attn_tp}: {error}") from None
    return mesh, parallel, (moe, tbo)


def layout_line(mesh: jax.sharding.Mesh, parallel: layer_ops.ParallelConfig, args) -> str:
    """The run's first line: the devices, the layout and the kernels chosen.

    Returns:
      E.g. ``"python -m jtbo.generate: 8 cpu devices (cpu) | mesh dp=4 x attn_tp=2 |
      attention native | experts xla | MoE ep, exchange dense | TBO auto | bfloat16"``.
    """
    first = mesh.devices.flat[0]
    return (
        f"python -m jtbo.generate: {mesh.devices.size} {first.platform} devices "
        f"({first.device_kind}) | "
        f"mesh dp={mesh.shape['dp']} x attn_tp={mesh.shape['attn_tp']} | "
        f"attention {parallel.attention_backend} | experts {parallel.moe.moe_runner_backend} | "
        f"MoE {args.moe_a2a_backend}, exchange {args.ep_exchange} | TBO {args.tbo} | {args.dtype}"
    )


def _serve(args, out, err) -> int:
    """Checks everything it can, loads the model and serves the prompts (the module docstring).

    Raises:
      UsageError: see ``main``.
    """
    prompts = _prompts(args)
    if not (args.model / "config.json").is_file():
        raise UsageError(f"--model {args.model}: no config.json (not a Hugging Face model)")
    config = hf.read_config(args.model)
    tokenizer = _load_tokenizer(args.model)
    mesh, parallel, (moe, tbo) = _layout(args, config)
    params = sampling.SamplingParams(args.temperature, args.top_p, args.seed)
    print(layout_line(mesh, parallel, args), file=err, flush=True)
    ids = [tokenizer.encode(text).ids for text in prompts]
    dtype = DTYPES[args.dtype]
    model = hf.from_pretrained(args.model, dtype=dtype, mesh=mesh,
                               moe_a2a_backend=args.moe_a2a_backend)  # fmt: skip
    per_rank = arith.ceil_div(len(prompts), mesh.shape["dp"])
    runner = runner_lib.ModelRunner(
        model, mesh, moe=moe, tbo=tbo, dtype=dtype, max_running_requests=per_rank,
        max_total_tokens=per_rank * (max(map(len, ids)) + args.max_new_tokens),
        attention_backend=parallel.attention_backend, dp_padding=args.dp_padding,
        ep_routing_stats=args.ep_routing_stats,
    )  # fmt: skip
    _generate(runner, tokenizer, prompts, ids, args, params, out)
    return 0


def _generate(runner, tokenizer, prompts, ids, args, params, out) -> None:
    """Serves ``ids`` through ``runner.generate``, streaming, then prints the summary."""
    streamer = _Streamer(tokenizer, prompts, args.max_new_tokens, out)
    if len(prompts) == 1:
        out.write(prompts[0])
    start = time.perf_counter()
    results = runner.generate(
        ids, max_new_tokens=args.max_new_tokens, sampling_params=params, on_token=streamer,
        progress=False,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    made = sum(len(r.token_ids) for r in results)
    for index, result in enumerate(results):
        if result.error:
            out.write(f"[{index}] rejected: {result.error}\n")
    out.write(
        f"{'' if len(prompts) > 1 else chr(10)}{made} tokens in {seconds:.2f} s, "
        f"{made / max(seconds, 1e-9):.1f} tokens/s (compiles included)\n{runner.tbo_summary()}\n"
    )


def main(argv=None, out=None, err=None) -> int:
    """Runs the CLI.

    Args:
      argv: the flags (``sys.argv[1:]`` when None).
      out: where the text goes (stdout when None).
      err: where the layout line and errors go (stderr when None).

    Returns:
      0 when served; ``EXIT_USAGE`` for a usage error (a flag, prompt or file: argparse's
      own errors exit with it too); ``EXIT_RUN_ERROR`` for an error while loading or
      serving. Each error is one line on ``err``.
    """
    args = parser().parse_args(argv)
    out, err = out or sys.stdout, err or sys.stderr
    try:
        return _serve(args, out, err)
    except UsageError as error:
        print(f"python -m jtbo.generate: error: {error}", file=err)
        return EXIT_USAGE
    except (ValueError, OSError, RuntimeError) as error:
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        print(f"python -m jtbo.generate: error: {error} ({TRACEBACK_ENV}=1 shows where)",
              file=err)  # fmt: skip
        return EXIT_RUN_ERROR
