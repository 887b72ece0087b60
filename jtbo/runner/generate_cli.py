"""``python -m jtbo.generate``: serve a Hugging Face MoE checkpoint from the command line.

Loads ``--model DIR`` with ``jtbo.models.hf.from_pretrained`` straight onto a ``--dp`` x
``--attn-tp`` mesh, tokenizes the prompts (``--prompt``, repeatable, and ``--prompts-file``,
one prompt a line) with ``DIR/tokenizer.json`` (the ``tokenizers`` package: the ``hf``
extra), serves them as one batch through ``ModelRunner.generate`` (TBO ``on`` / ``off`` /
``auto``; greedy unless ``--temperature`` > 0) and streams the text: a single prompt's text
as its tokens arrive, several prompts each as one line when it is complete. Then it prints
the tokens generated, tokens/s (compiles included) and how many steps ran with two-batch
overlap (``ModelRunner.tbo_summary``).
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jtbo.attention import backend as attn_backend_lib
from jtbo.collectives import ep_config
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import hf, layer_ops
from jtbo.runner import runner as runner_lib
from jtbo.runner import sampling, tbo_options
from jtbo.split import arith

EXIT_USAGE = 2
TBO_CHOICES = {"on": True, "off": False, "auto": "auto"}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def parser() -> argparse.ArgumentParser:
    """The command line (also used by ``jtbo/generate.py`` to size the CPU device count)."""
    p = argparse.ArgumentParser(prog="python -m jtbo.generate", description=__doc__)
    p.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help="a file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dp", type=int, default=None, help="DP ranks (default: devices / attn-tp)")
    p.add_argument("--attn-tp", type=int, default=1, help="devices per DP rank")
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
        type=Path,
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
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p


def _load_tokenizer(directory: Path):
    try:
        import tokenizers
    except ImportError as error:
        raise SystemExit(
            "python -m jtbo.generate needs the `tokenizers` package: pip install 'jtbo[hf]'"
        ) from error
    path = directory / "tokenizer.json"
    if not path.exists():
        raise SystemExit(f"{directory}: no tokenizer.json")
    return tokenizers.Tokenizer.from_file(str(path))


def _prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        lines = args.prompts_file.read_text().splitlines()
        prompts += [line for line in lines if line.strip()]
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
    dp = args.dp or max(len(jax.devices()) // args.attn_tp, 1)
    return mesh_lib.make_mesh(dp, args.attn_tp)


def main(argv=None, out=None) -> int:
    """Runs the CLI; returns the exit code (0: served, 2: no prompt)."""
    args = parser().parse_args(argv)
    out = out or sys.stdout
    prompts = _prompts(args)
    if not prompts:
        print("no prompt: pass --prompt TEXT or --prompts-file FILE", file=sys.stderr)
        return EXIT_USAGE
    params = sampling.SamplingParams(args.temperature, args.top_p, args.seed)
    tokenizer = _load_tokenizer(args.model)
    ids = [tokenizer.encode(text).ids for text in prompts]
    mesh, dtype = _mesh(args), DTYPES[args.dtype]
    model = hf.from_pretrained(args.model, dtype=dtype, mesh=mesh,
                               moe_a2a_backend=args.moe_a2a_backend)  # fmt: skip
    per_rank = arith.ceil_div(len(prompts), mesh.shape["dp"])
    moe = layer_ops.MoEOptions(moe_a2a_backend=args.moe_a2a_backend, ep_exchange=args.ep_exchange)
    runner = runner_lib.ModelRunner(
        model, mesh, moe=moe,
        tbo=tbo_options.TboOptions(enable_two_batch_overlap=TBO_CHOICES[args.tbo]), dtype=dtype,
        max_running_requests=per_rank,
        max_total_tokens=per_rank * (max(map(len, ids)) + args.max_new_tokens),
        attention_backend=args.attention_backend, dp_padding=args.dp_padding,
        ep_routing_stats=args.ep_routing_stats,
    )  # fmt: skip
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
    return 0
