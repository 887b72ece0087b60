"""Native paged attention throughput: ``python -m jtbo.bench attention [--small] [flags]``.

Two cases on one device, each jitted once (KV cache donated, as the runner does) and timed
over ``--iters`` steps after a warm-up:

* extend: ``--extend-tokens`` new tokens (default 8192) in ``--extend-seqs`` prompts, no prefix;
* decode: ``--decode-seqs`` sequences (default 256) at ``--decode-context`` tokens (4096).

Prints tokens/s and the memory high-water mark from ``device.memory_stats()`` where the
platform reports it (GPU), plus XLA's compiled temp-buffer size, and one JSON line per case.
``--small`` shrinks everything so the benchmark runs on a CPU in seconds.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import attention
from jtbo.attention import kv_cache as kv_cache_lib


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jtbo.bench attention")
    parser.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    parser.add_argument("--extend-tokens", type=int, default=8192)
    parser.add_argument("--extend-seqs", type=int, default=4)
    parser.add_argument("--decode-seqs", type=int, default=256)
    parser.add_argument("--decode-context", type=int, default=4096)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--query-tile", type=int, default=64)
    parser.add_argument("--kv-block", type=int, default=256)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    if args.small:
        args.extend_tokens, args.extend_seqs = 256, 2
        args.decode_seqs, args.decode_context = 16, 128
        args.q_heads, args.kv_heads, args.head_dim = 4, 2, 32
        args.dtype, args.query_tile, args.kv_block, args.iters = "float32", 32, 64, 2
    return args


def _cache(args, num_seqs: int, seq_len: int) -> attention.KVCache:
    """A one-layer cache whose sequence ``i`` owns slots ``1 + i * seq_len ..`` (random K/V)."""
    slots = 1 + num_seqs * seq_len
    shape = (1, slots, args.kv_heads, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 2)
    table = 1 + np.arange(num_seqs * seq_len, dtype=np.int32).reshape(num_seqs, seq_len)
    return kv_cache_lib.KVCache(
        k=jax.random.normal(keys[0], shape, args.dtype),
        v=jax.random.normal(keys[1], shape, args.dtype),
        req_to_token=jnp.asarray(table),
    )


def _qkv(args, num_tokens: int):
    keys = jax.random.split(jax.random.key(1), 3)
    return (
        jax.random.normal(keys[0], (num_tokens, args.q_heads, args.head_dim), args.dtype),
        jax.random.normal(keys[1], (num_tokens, args.kv_heads, args.head_dim), args.dtype),
        jax.random.normal(keys[2], (num_tokens, args.kv_heads, args.head_dim), args.dtype),
    )


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


def _peak_bytes(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("peak_bytes_in_use")


def _run_case(args, case) -> dict:
    name, capacity, md, cache, num_tokens = case
    backend = attention.NativeAttnBackend(
        capacity, attention.NativeAttentionConfig(kv_block=args.kv_block)
    )
    step = jax.jit(backend.forward, static_argnums=(3,), donate_argnums=(5,))
    q, k, v = _qkv(args, capacity.token_capacity)
    md = jax.device_put(md)
    compiled = step.lower(q, k, v, 0, md, cache).compile()
    analysis = compiled.memory_analysis()
    out, cache = step(q, k, v, 0, md, cache)
    out.block_until_ready()
    start = time.perf_counter()
    for _ in range(args.iters):
        out, cache = step(q, k, v, 0, md, cache)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / args.iters
    return dict(
        case=name,
        tokens=num_tokens,
        step_ms=seconds * 1e3,
        tokens_per_s=num_tokens / seconds,
        peak_bytes_in_use=_peak_bytes(jax.devices()[0]),
        compiled_temp_bytes=None if analysis is None else analysis.temp_size_in_bytes,
        kv_pool_bytes=int(cache.k.nbytes + cache.v.nbytes),
        finite=bool(jnp.isfinite(out).all()),
    )


def main(argv: list[str]) -> None:
    """Runs the extend and decode cases and prints one summary and one JSON line each.

    Args:
      argv: command-line flags (see ``--help``).

    Raises:
      SystemExit: bad flags, or a case produced non-finite outputs.
    """
    args = _parse(argv)
    args.dtype = jnp.dtype(args.dtype)
    print(f"device: {jax.devices()[0].device_kind}, dtype {args.dtype}, kv_block {args.kv_block}")
    for case in (_extend_case(args), _decode_case(args)):
        result = _run_case(args, case)
        peak = result["peak_bytes_in_use"]
        print(
            f"{result['case']:>6}: {result['tokens']} tokens, {result['step_ms']:.3f} ms/step, "
            f"{result['tokens_per_s']:.1f} tokens/s, peak "
            f"{'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}, compiled temp "
            f"{(result['compiled_temp_bytes'] or 0) / 2**20:.1f} MiB, KV pool "
            f"{result['kv_pool_bytes'] / 2**20:.1f} MiB"
        )
        print(json.dumps(result))
        if not result["finite"]:
            raise SystemExit(f"{result['case']}: non-finite attention output")
