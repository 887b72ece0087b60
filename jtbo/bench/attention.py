"""Paged attention throughput: ``python -m jtbo.bench attention [--small] [flags]``.

Cases on one device, each jitted once per backend (KV cache donated, as the runner does) and
timed over ``--iters`` steps after a warm-up (``--cases``, default extend and decode):

* extend: ``--extend-tokens`` new tokens (default 8192) in ``--extend-seqs`` prompts, no prefix;
* decode: ``--decode-seqs`` sequences (default 256) at ``--decode-context`` tokens (4096);
* verify: ``--decode-seqs`` sequences at ``--decode-context`` tokens, the last ``--draft``
  of them draft tokens verified with a causal EAGLE mask (TARGET_VERIFY).

``--backends`` picks the attention backends ("native", "pallas", "triton"; default native and
pallas). The kernel backends ("pallas", and its jax-triton twin "triton") run the extend
kernel for the extend case, its launch shape from the ``--extend-block-kv`` ..
``--extend-num-stages`` flags, and the paged kernel for decode and verify, from the
``--block-kv`` .. ``--num-stages`` flags. Each of those takes a comma list (``--block-rows
64,128 --num-warps 4,8``): each kernel backend then runs once per combination in the same
process, a sweep of the kernel's launch shapes whose rows name their config.
Prints tokens/s (extend also TF/s on the causal FLOPs,
``2 * q_heads * (qk_dim + v_dim) * L (L + 1) / 2`` per prompt of ``L`` tokens, and their
fraction of a dense bf16 ``8192^3`` matmul's rate measured in the same run) and the memory
high-water mark from ``device.memory_stats()`` where the platform
reports it (GPU), plus XLA's compiled temp-buffer size; for decode and verify also the K/V
bytes the step must read (every sequence's context, K and V, all KV heads) per second and
their fraction of the device's copy bandwidth, measured in the same run (torch ``copy_`` of
1 GiB where torch sees the GPU, else a fused XLA copy). Each later backend's output is
compared with the first one's (max abs difference), and one JSON line per (case, backend)
follows. ``--kernel-time`` traces ``--iters`` more steps on a GPU and splits a step's time
into the attention kernel's own and the other kernels' (the K/V write into the pool, the
output's zero fill), with the extend kernel's own TF/s. ``--small`` shrinks everything so the
benchmark runs on a CPU in seconds.

``--mla`` benchmarks DeepSeek's multi-head latent attention instead (``backend.forward_mla``):
the pool holds one latent row of ``--kv-lora-rank + --qk-rope-dim`` values per token (V3's
512 + 64 by default), ``--q-heads`` heads with ``--qk-nope-dim`` / ``--v-head-dim``. Decode and
verify attend in the absorbed form: the Pallas backend through the paged kernel over the
latent rows, the native one through its blocked attention. Extend attends decompressed
natively on both backends. The KV bytes are the latent rows read.
"""

import argparse
import dataclasses
import functools
import glob
import itertools
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import attention
from jtbo.attention import backend as backend_lib
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.attention import paged
from jtbo.bench import device_rates, kernel_time, limits, options
from jtbo.core import cli_arguments

CASES = ("extend", "decode", "verify")
KNOBS = tuple(field.name for field in dataclasses.fields(attention.PagedAttentionConfig))
"""The paged kernel's launch-shape flags (``PagedAttentionConfig``'s fields)."""
EXTEND_KNOBS = tuple(field.name for field in dataclasses.fields(attention.ExtendAttentionConfig))
"""The extend kernel's launch-shape flags (``--extend-`` + ``ExtendAttentionConfig``'s fields)."""
KERNEL_BACKENDS = ("pallas", "triton")
"""The backends whose kernels take the launch-shape flags."""
MATMUL_N = 8192  # size of the dense bf16 matmul yardstick (256 with --small)
CEILING_BYTES = 1 << 30  # size of the copy yardstick (16 MiB with --small)


_POSITIVE = cli_arguments.positive_int


@dataclasses.dataclass(frozen=True)
class CaseOptions:
    """The cases, backends and shapes the benchmark times (the flags before the knobs)."""

    small: bool = options.option(False, action="store_true", help="tiny shapes for a CPU smoke run")
    cases: str = options.option("extend,decode", help=f"comma list of {CASES}")
    backends: str = options.option(
        "native,pallas", help=f"comma list of {tuple(backend_lib.ATTENTION_BACKENDS)}"
    )
    extend_tokens: int = options.option(8192, type=_POSITIVE)  # extend: tokens per step
    extend_seqs: int = options.option(4, type=_POSITIVE)  # extend: sequences per step
    decode_seqs: int = options.option(256, type=_POSITIVE)  # decode: sequences per step
    decode_context: int = options.option(4096, type=_POSITIVE)  # decode: KV length
    draft: int = options.option(4, type=_POSITIVE, help="verify: draft tokens per sequence")
    q_heads: int = options.option(32, type=_POSITIVE)  # query heads
    kv_heads: int = options.option(8, type=_POSITIVE)  # KV heads
    head_dim: int = options.option(128, type=_POSITIVE)  # width of a head
    dtype: str = options.option("bfloat16")  # the queries' and the pool's dtype
    query_tile: int = options.option(64, type=_POSITIVE)  # extend: query rows per tile
    kv_block: int = options.option(256, type=_POSITIVE, help="native: KV block")


@dataclasses.dataclass(frozen=True)
class TimingAndMlaOptions:
    """The timing and MLA flags (after the kernels' launch-shape knobs)."""

    kernel_time: bool = options.option(
        False, action="store_true",
        help="on a GPU, also trace the timed steps and split their time into the attention "
        "kernel's own (jtbo_*) and the other kernels' (the K/V write, the output's zeros)",
    )  # fmt: skip
    iters: int = options.option(10, type=_POSITIVE)  # timed steps per case
    mla: bool = options.option(False, action="store_true", help="MLA over a latent pool (above)")
    kv_lora_rank: int = options.option(512, type=_POSITIVE, help="MLA latent width")
    qk_rope_dim: int = options.option(64, type=_POSITIVE, help="MLA RoPE key width")
    qk_nope_dim: int = options.option(128, type=_POSITIVE, help="MLA query/key width")
    v_head_dim: int = options.option(128, type=_POSITIVE, help="MLA value width")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jtbo.bench attention")
    options.add_arguments(parser, CaseOptions)
    _add_knob_arguments(parser)
    options.add_arguments(parser, TimingAndMlaOptions)
    parser.set_defaults(ceiling_bytes=CEILING_BYTES, matmul_n=MATMUL_N)
    args = parser.parse_args(argv)
    args.cases, args.backends = args.cases.split(","), args.backends.split(",")
    for name in args.cases:
        if name not in CASES:
            parser.error(f"--cases: {name!r} is not one of {CASES}")
    for name in args.backends:
        backend_lib.backend_class(name)  # ValueError naming the backend
    _fill_paged_defaults(args)
    if args.small:
        _shrink(args)
    try:  # after --small's knobs: the ones that run
        args.paged_configs = _configs(args, attention.PagedAttentionConfig, KNOBS, "")
        args.extend_configs = _configs(
            args, attention.ExtendAttentionConfig, EXTEND_KNOBS, "extend_"
        )
    except ValueError as error:
        parser.error(f"kernel launch shape: {error}")
    return args


def _add_knob_arguments(parser: argparse.ArgumentParser) -> None:
    """One comma-list flag per launch-shape knob of the paged and the extend kernel (the
    paged kernel's defaults depend on ``--mla``: ``_fill_paged_defaults``)."""
    for name in KNOBS:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=_int_list, default=None,
            help=f"pallas, triton: PagedAttentionConfig.{name} (a comma list sweeps it; "
            "default: paged.DEFAULT_CONFIG's, with --mla paged.LATENT_CONFIG's)",
        )  # fmt: skip
    extend_defaults = attention.ExtendAttentionConfig()
    for name in EXTEND_KNOBS:
        parser.add_argument(
            f"--extend-{name.replace('_', '-')}", type=_int_list,
            default=[getattr(extend_defaults, name)],
            help=f"pallas, triton, extend case: ExtendAttentionConfig.{name} (a comma list "
            "sweeps it)",
        )  # fmt: skip


def _fill_paged_defaults(args: argparse.Namespace) -> None:
    """The paged kernel's knobs left unset take the backend's default for the pool: MLA's
    latent pool runs ``paged.LATENT_CONFIG``, K/V head pools ``paged.DEFAULT_CONFIG``."""
    defaults = paged.LATENT_CONFIG if args.mla else paged.DEFAULT_CONFIG
    for name in KNOBS:
        if getattr(args, name) is None:
            setattr(args, name, [getattr(defaults, name)])


def _shrink(args: argparse.Namespace) -> None:
    """``--small``: tiny shapes, few iterations and small yardsticks (a CPU smoke run)."""
    args.extend_tokens, args.extend_seqs = 256, 2
    args.decode_seqs, args.decode_context = 16, 128
    args.q_heads, args.kv_heads, args.head_dim = 4, 2, 32
    args.dtype, args.query_tile, args.kv_block, args.iters = "float32", 32, 64, 2
    args.block_kv, args.min_split_kv, args.ceiling_bytes = [32], [32], 1 << 24
    args.extend_block_kv, args.matmul_n = [32], 256
    args.kv_lora_rank, args.qk_rope_dim, args.qk_nope_dim, args.v_head_dim = 32, 16, 16, 16


def _int_list(text: str) -> list[int]:
    """A comma list of integers (``--num-warps 4,8``)."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from error


def _configs(args, config_class, knobs: tuple[str, ...], flag_prefix: str) -> list:
    """Every combination of a kernel's knob flags' values, in flag order (the first varies
    slowest), as ``config_class`` objects.

    Raises:
      ValueError: a combination the kernel refuses (the config class checks).
    """
    values = [getattr(args, flag_prefix + name) for name in knobs]
    return [
        config_class(**dict(zip(knobs, combination, strict=True)))
        for combination in itertools.product(*values)
    ]


def _cache(args, num_seqs: int, seq_len: int) -> attention.KVCache:
    """A one-layer cache whose sequence ``i`` owns slots ``1 + i * seq_len ..`` (random K/V;
    with ``--mla`` one latent row per slot and no values)."""
    slots = 1 + num_seqs * seq_len
    k_shape = (1, slots, args.kv_heads, args.head_dim)
    if args.mla:
        k_shape = (1, slots, 1, args.kv_lora_rank + args.qk_rope_dim)
    keys = jax.random.split(jax.random.key(0), 2)
    table = 1 + np.arange(num_seqs * seq_len, dtype=np.int32).reshape(num_seqs, seq_len)
    return kv_cache_lib.KVCache(
        k=jax.random.normal(keys[0], k_shape, args.dtype),
        v=None if args.mla else jax.random.normal(keys[1], k_shape, args.dtype),
        req_to_token=jnp.asarray(table),
    )


def _qkv(args, num_tokens: int):
    """The step's inputs: ``(q, k, v)``, or with ``--mla`` ``(q_nope, q_pe, latent, w_kv_b)``."""
    if args.mla:
        return _mla_inputs(args, num_tokens)
    keys = jax.random.split(jax.random.key(1), 3)
    return (
        jax.random.normal(keys[0], (num_tokens, args.q_heads, args.head_dim), args.dtype),
        jax.random.normal(keys[1], (num_tokens, args.kv_heads, args.head_dim), args.dtype),
        jax.random.normal(keys[2], (num_tokens, args.kv_heads, args.head_dim), args.dtype),
    )


def _mla_inputs(args, num_tokens: int):
    keys = jax.random.split(jax.random.key(1), 4)
    heads, nope, rope, rank = args.q_heads, args.qk_nope_dim, args.qk_rope_dim, args.kv_lora_rank
    up = jax.random.normal(keys[3], (rank, heads, nope + args.v_head_dim), args.dtype)
    return (
        jax.random.normal(keys[0], (num_tokens, heads, nope), args.dtype),
        jax.random.normal(keys[1], (num_tokens, heads, rope), args.dtype),
        jax.random.normal(keys[2], (num_tokens, rank + rope), args.dtype),
        up * rank**-0.5,  # keeps the up-projected keys near unit scale
    )


def _step(args, backend):
    """The jitted attention of one layer (0) with the cache donated, and its layer position."""
    if not args.mla:
        return jax.jit(backend.forward, static_argnums=(3,), donate_argnums=(5,))
    scaling = (args.qk_nope_dim + args.qk_rope_dim) ** -0.5
    forward = functools.partial(backend.forward_mla, scaling=scaling)
    return jax.jit(forward, static_argnums=(4,), donate_argnums=(6,))


def _extend_case(args):
    n, per_seq = args.extend_seqs, args.extend_tokens // args.extend_seqs
    capacity = attention.extend_capacity(n * per_seq, n, per_seq, query_tile=args.query_tile)
    cache = _cache(args, n, per_seq)
    md = attention.build_metadata(
        capacity,
        req=np.arange(n),
        q_start=np.arange(n) * per_seq,
        q_len=np.full(n, per_seq),
        q_pos=np.zeros(n, int),
        kv_len=np.full(n, per_seq),
        out_cache_loc=np.asarray(cache.req_to_token).reshape(-1),
        num_tokens=n * per_seq,
    )
    return "extend", capacity, md, cache, n * per_seq


def _decode_case(args):
    n, context = args.decode_seqs, args.decode_context
    capacity = attention.decode_capacity(n, context)
    cache = _cache(args, n, context)
    md = attention.build_metadata(
        capacity,
        req=np.arange(n),
        q_start=np.arange(n),
        q_len=np.ones(n, int),
        q_pos=np.full(n, context - 1),
        kv_len=np.full(n, context),
        out_cache_loc=np.asarray(cache.req_to_token)[:, -1],
        num_tokens=n,
    )
    return "decode", capacity, md, cache, n


def _verify_case(args):
    n, context, draft = args.decode_seqs, args.decode_context, args.draft
    capacity = attention.verify_capacity(n, draft, context)
    cache = _cache(args, n, context)
    prefix = context - draft
    # A chain of drafts: draft i sees the prefix and drafts 0..i (causal among themselves).
    rows = np.arange(context)[None, :] <= prefix + np.arange(draft)[:, None]
    md = attention.build_metadata(
        capacity,
        req=np.arange(n),
        q_start=np.arange(n) * draft,
        q_len=np.full(n, draft),
        q_pos=np.full(n, prefix),
        kv_len=np.full(n, context),
        out_cache_loc=np.asarray(cache.req_to_token)[:, prefix:].reshape(-1),
        num_tokens=n * draft,
        mask_rows=[rows] * n,
    )
    return "verify", capacity, md, cache, n * draft


def _causal_flops(args) -> float:
    """Matmul FLOPs of the extend case's causal attention: per prompt of ``L`` tokens, each
    head's ``L (L + 1) / 2`` visible (query, key) pairs cost a score (``2 * qk_dim``) and a
    value product (``2 * v_dim``)."""
    per_seq = args.extend_tokens // args.extend_seqs
    qk_dim = args.qk_nope_dim + args.qk_rope_dim if args.mla else args.head_dim
    v_dim = args.v_head_dim if args.mla else args.head_dim
    pairs = limits.attention_pairs([per_seq] * args.extend_seqs)
    return 2.0 * args.q_heads * (qk_dim + v_dim) * pairs


def _kv_read_bytes(md, cache) -> int:
    """K/V bytes the step must read: every real tile's context, all KV heads, K and V."""
    kv_len = np.where(np.asarray(md.tile_q_len) > 0, np.asarray(md.tile_kv_len), 0)
    value_width = 0 if cache.v is None else cache.v.shape[3]  # MLA: the latent rows only
    per_token = cache.k.shape[2] * (cache.k.shape[3] + value_width) * cache.k.dtype.itemsize
    return int(kv_len.sum()) * per_token


def _peak_bytes(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("peak_bytes_in_use")


def _backend(args, name: str, capacity, config):
    if isinstance(config, attention.ExtendAttentionConfig):
        return backend_lib.backend_class(name)(capacity, extend_config=config)
    if name in KERNEL_BACKENDS:
        return backend_lib.backend_class(name)(capacity, config)
    return backend_lib.NativeAttnBackend(
        capacity, attention.NativeAttentionConfig(kv_block=args.kv_block)
    )


def _run_case(args, case, backend_name: str, config=None) -> tuple[dict, jax.Array]:
    name, capacity, md, cache, num_tokens = case
    backend = _backend(args, backend_name, capacity, config)
    step = _step(args, backend)
    inputs = _qkv(args, capacity.token_capacity)
    kv_bytes = _kv_read_bytes(md, cache) if name != "extend" else None
    md = jax.device_put(md)
    cache = jax.tree.map(jnp.copy, cache)  # the case's cache serves every backend
    compiled = step.lower(*inputs, 0, md, cache).compile()
    analysis = compiled.memory_analysis()
    out, cache = step(*inputs, 0, md, cache)
    out.block_until_ready()
    start = time.perf_counter()
    for _ in range(args.iters):
        out, cache = step(*inputs, 0, md, cache)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / args.iters
    kernels = _kernel_times(step, (*inputs, 0, md, cache), args.iters) if args.kernel_time else None
    if kernels is not None:
        out, cache = kernels.pop("outputs")
    result = dict(
        case=name,
        backend=backend_name,
        tokens=num_tokens,
        step_ms=seconds * 1e3,
        tokens_per_s=num_tokens / seconds,
        tflops=None if name != "extend" else _causal_flops(args) / seconds / 1e12,
        dense_tflops=None if name != "extend" else args.dense_tflops,
        kernel_config=None if config is None else dataclasses.asdict(config),
        kv_read_bytes=kv_bytes,
        kv_gb_per_s=None if kv_bytes is None else kv_bytes / seconds / 1e9,
        peak_bytes_in_use=_peak_bytes(jax.devices()[0]),
        compiled_temp_bytes=None if analysis is None else analysis.temp_size_in_bytes,
        kv_pool_bytes=int(cache.k.nbytes + (0 if cache.v is None else cache.v.nbytes)),
        finite=bool(jnp.isfinite(out).all()),
        **(kernels or {}),
    )
    if kernels and name == "extend":
        result["kernel_tflops"] = _causal_flops(args) / (kernels["kernel_ms"] / 1e3) / 1e12
    return result, out


def _kernel_times(step, step_args, iters: int) -> dict:
    """GPU time per step of the attention kernels (``jtbo_*``) and of every other kernel,
    from a trace of ``iters`` more steps; no figures off GPUs or without such kernels.

    The trace's steps donate the cache like the timed ones, so the last outputs are returned
    (``"outputs"``) for the caller to keep using.
    """
    folder = tempfile.mkdtemp(prefix="jtbo_attention_")
    *head, cache = step_args
    with jax.profiler.trace(folder):
        for _ in range(iters):
            out, cache = step(*head, cache)
        out.block_until_ready()
    times = dict(outputs=(out, cache))
    if jax.devices()[0].platform != "gpu":
        return times
    (path,) = glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)
    kernels = kernel_time.gpu_kernels(kernel_time.read_trace(path))
    ours = sum(k.microseconds for k in kernels if k.name.startswith("jtbo_"))
    others = sum(k.microseconds for k in kernels if not k.name.startswith("jtbo_"))
    if not ours:  # the native backend: XLA's kernels only
        return times
    largest = kernel_time.largest_compute_kernels(kernels, iters, top=6)
    return times | dict(
        kernel_ms=ours / iters / 1e3, other_kernel_ms=others / iters / 1e3, largest=largest
    )


def _uses_extend_kernel(args, case) -> bool:
    """Whether the Pallas backend runs the extend kernel for ``case`` (else the paged one;
    MLA's extend has its own path, ``backend.forward_mla``)."""
    return not args.mla and backend_lib.PallasAttnBackend(case[1]).uses_extend_kernel()


def _line(result: dict, ceiling: tuple[float, str]) -> str:
    peak = result["peak_bytes_in_use"]
    config = result["kernel_config"]
    label = "" if config is None else " " + ",".join(f"{k}={v}" for k, v in config.items())
    tflops = ""
    if result["tflops"] is not None:
        tflops = (
            f", {result['tflops']:.1f} TF/s causal = "
            f"{result['tflops'] / result['dense_tflops']:.2f} of dense"
        )
    line = (
        f"{result['case']:>6} {result['backend']:>6}{label}: {result['tokens']} tokens, "
        f"{result['step_ms']:.3f} ms/step, {result['tokens_per_s']:.1f} tokens/s{tflops}, peak "
        f"{'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}, compiled temp "
        f"{(result['compiled_temp_bytes'] or 0) / 2**20:.1f} MiB, KV pool "
        f"{result['kv_pool_bytes'] / 2**20:.1f} MiB"
    )
    if result.get("kernel_ms") is not None:
        line += (
            f"; kernels: attention {result['kernel_ms']:.3f} ms, others "
            f"{result['other_kernel_ms']:.3f} ms"
        )
        if result.get("kernel_tflops") is not None:
            line += (
                f", attention kernel {result['kernel_tflops']:.1f} TF/s = "
                f"{result['kernel_tflops'] / result['dense_tflops']:.2f} of dense"
            )
    if result["kv_gb_per_s"] is not None:
        line += (
            f", KV read {result['kv_read_bytes'] / 2**20:.1f} MiB at "
            f"{result['kv_gb_per_s']:.0f} GB/s = {result['kv_gb_per_s'] / ceiling[0]:.2f} of "
            f"the {ceiling[1]} ceiling"
        )
    return line


def main(argv: list[str]) -> None:
    """Runs the chosen cases on every chosen backend; prints a summary and a JSON line each.

    Args:
      argv: command-line flags (see ``--help``).

    Raises:
      SystemExit: bad flags, or a case produced non-finite outputs.
    """
    args = _parse(argv)
    args.dtype = jnp.dtype(args.dtype)
    builders = dict(extend=_extend_case, decode=_decode_case, verify=_verify_case)
    ceiling = device_rates.copy_gbs(args.ceiling_bytes, iters=max(args.iters, 2), reps=3)
    args.dense_tflops = device_rates.matmul_tflops(args.matmul_n, iters=max(args.iters, 2), reps=3)
    print(
        f"device: {jax.devices()[0].device_kind}, {'MLA, ' if args.mla else ''}dtype "
        f"{args.dtype}, native kv_block "
        f"{args.kv_block}, pallas {len(args.paged_configs)} paged and {len(args.extend_configs)} "
        f"extend launch shape(s); copy ceiling "
        f"{ceiling[0]:.0f} GB/s "
        f"({ceiling[1]}, {args.ceiling_bytes >> 20} MiB); dense bf16 matmul "
        f"{args.dense_tflops:.1f} TF/s ({args.matmul_n}^3)"
    )
    for name in args.cases:
        case, first = builders[name](args), None
        kernel_configs = (
            args.extend_configs if _uses_extend_kernel(args, case) else args.paged_configs
        )
        runs = [
            (backend_name, config)
            for backend_name in args.backends
            for config in (kernel_configs if backend_name in KERNEL_BACKENDS else [None])
        ]
        for backend_name, config in runs:
            result, out = _run_case(args, case, backend_name, config)
            if first is None:
                first = (backend_name, out)
            else:
                diff = jnp.abs(out.astype(jnp.float32) - first[1].astype(jnp.float32)).max()
                result[f"max_abs_diff_vs_{first[0]}"] = float(diff)
            print(_line(result, ceiling))
            if result.get("largest"):
                print(f"  {result['largest']}")
            print(json.dumps(result))
            if not result["finite"]:
                raise SystemExit(f"{name} {backend_name}: non-finite attention output")
