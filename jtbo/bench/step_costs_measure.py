"""Measures the step model's per-operation cost table on one device (``bench predict --measure``).

The step model (``jtbo.analysis.step_model``) prices every operation of a TBO layer from this
table, so everything it needs is timed here, each at a grid of sizes that the model then
interpolates:

* ``dense_gemm``: a bf16 ``[rows, K] @ [K, N]`` matmul (float32 accumulation, bf16 out) for a
  few weight shapes ``K x N`` spanning the model's projections (the router's to the dense MLP's),
  at rows from decode to prefill sizes;
* ``grouped_gemm``: the routed experts' layer (``experts.experts_capacity`` with the device's
  grouped-GEMM kernel, ``impl="pallas"`` on a GPU) for DeepSeek-V3's expert shape at a few local
  expert counts and rows per expert (uniform random routing);
* ``attention``: the paged attention of ``bench attention`` (MLA over a latent pool and GQA),
  extend at a few prompt lengths and decode at a few (sequences, context) pairs;
* ``rowwise``: an RMSNorm, a residual add, a row gather and the router's top-k at a grid of rows;
* ``host_ms``: one step's host round trip (two small uploads, a jitted call, one read-back);
* ``runner_host``: the host time of the runner's own step, plain and TBO, at prefill and
  decode: ``ModelRunner.run_plan``'s host phases before the devices run (packing the plan and
  issuing its transfers, then the jitted call until it returns; ``bench tbo``'s phase table),
  for ``bench tbo``'s GQA model (``MoEConfig.deepseek_v3_gqa_reduced``) on one device;
* ``slowdown``: how much longer a stream of matmuls takes while an exchange runs beside it on
  the same GPU (torch, two CUDA streams): ``sm`` beside a device-to-device copy kernel (an
  exchange that runs on the SMs, as NCCL's and DeepEP's do), ``copy`` beside a device-to-host
  copy on a copy engine (the peer copy's engines). 1.0 where torch cannot run (the CPU).

Every time is the median per call over repeated batches (``device_rates.time_fn``). ``small``
shrinks every grid so the whole table is measured on a CPU in seconds (for tests of the code,
not a table to predict from).
"""

import datetime
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import attention as attention_bench
from jtbo.bench import device_rates, grouped_gemm, kernels

VERSION = 1
DENSE_SHAPES = ((7168, 256), (7168, 2048), (7168, 9216), (7168, 36864))
DENSE_ROWS = (16, 64, 256, 1024, 4096, 16384)
EXPERT_COUNTS = (4, 8, 32)
ROWS_PER_EXPERT = (16, 64, 256, 1024, 4096, 16384)
ROWWISE_ROWS = (64, 512, 4096, 32768)
ROUTING_EXPERTS = 256
HIDDEN, EXPERT_FFN = 7168, 2048
MLA_EXTEND_LENS = (1024, 2048, 4096)
EXTEND_TOKENS = 8192
MLA_DECODE = ((32, 2048), (128, 2048), (256, 2048), (256, 4096))
GQA_DECODE = ((64, 1024), (128, 1024), (256, 1024), (256, 4096))
SMALL = dict(
    dense_shapes=((64, 16), (64, 128)),
    dense_rows=(4, 32),
    expert_counts=(2, 4),
    rows_per_expert=(4, 16),
    rowwise_rows=(8, 64),
    hidden=64,
    ffn=32,
)
FULL = dict(
    dense_shapes=DENSE_SHAPES,
    dense_rows=DENSE_ROWS,
    expert_counts=EXPERT_COUNTS,
    rows_per_expert=ROWS_PER_EXPERT,
    rowwise_rows=ROWWISE_ROWS,
    hidden=HIDDEN,
    ffn=EXPERT_FFN,
)


def _ms(fn, args, iters: int = 3, reps: int = 3) -> float:
    """Median milliseconds per call of a jitted ``fn(*args)`` (one warm-up call compiles)."""
    return device_rates.time_fn(fn, args, warmup=1, iters=iters, reps=reps) * 1e3


def _ms_copies(fn, make_args, copies: int) -> float:
    """Milliseconds of one ``fn(*args)`` from one jitted program running ``copies`` of it on
    distinct inputs (``make_args(i)``): a lone small call would time the host's dispatch, not
    the device, while in a step every operation runs inside one program."""
    sets = [make_args(i) for i in range(copies)]
    many = jax.jit(lambda sets: tuple(fn(*args) for args in sets))
    return _ms(many, (sets,)) / copies


def _copies(nbytes: float) -> int:
    """How many copies of an operation over ``nbytes`` of inputs one timed program runs."""
    return int(max(1, min(16, 2e9 // max(nbytes, 1))))


def _normal(key: int, shape, dtype=jnp.bfloat16) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def dense_gemm(shapes, rows) -> list[dict]:
    """Per weight shape ``(K, N)``: ``{"k", "n", "rows", "ms"}`` of ``[rows, K] @ [K, N]``."""

    def matmul(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    curves = []
    for k, n in shapes:
        times = [
            _ms_copies(
                matmul,
                lambda i, m=m, k=k, n=n: (_normal(2 + i, (m, k)), _normal(40 + i, (k, n))),
                _copies(2 * (m * k + k * n + m * n)),
            )
            for m in rows
        ]
        curves.append(dict(k=k, n=n, rows=list(rows), ms=times))
        _log(
            f"dense_gemm {k}x{n}: "
            + ", ".join(f"{m}:{t:.3f}" for m, t in zip(rows, times, strict=True))
        )
    return curves


def _grouped_point(num_experts: int, rows_per_expert: int, hidden: int, ffn: int) -> float:
    """Milliseconds of one routed-expert layer with ``rows_per_expert`` pairs per expert."""
    top_k = min(8, num_experts)
    tokens = max(1, rows_per_expert * num_experts // top_k)
    shapes = grouped_gemm.Shapes(hidden, ffn, num_experts, top_k)
    ids, routing = grouped_gemm.route(tokens, shapes, skew=0.0, seed=0)
    capacity = grouped_gemm.capacity_for(tokens, shapes, factor=2.0)
    impl = "pallas" if jax.default_backend() == "gpu" else "capacity"
    layer = grouped_gemm.layer_fn(impl, shapes, capacity)
    weight_bytes = 2 * 3 * num_experts * hidden * ffn
    copies = min(4, _copies(weight_bytes + 2 * tokens * hidden))

    def make(i):
        x, weights = grouped_gemm.make_inputs(tokens, shapes, jnp.bfloat16, jax.random.key(3 + i))
        return x, jnp.asarray(ids), jnp.asarray(routing), weights

    return _ms_copies(layer, make, copies)


def grouped(expert_counts, rows_per_expert, hidden: int, ffn: int) -> dict:
    """``{"hidden", "ffn", "curves": [{"experts", "rows_per_expert", "ms"}]}``."""
    curves = []
    for count in expert_counts:
        times = [_grouped_point(count, r, hidden, ffn) for r in rows_per_expert]
        curves.append(dict(experts=count, rows_per_expert=list(rows_per_expert), ms=times))
        _log(
            f"grouped_gemm E={count}: "
            + ", ".join(f"{r}:{t:.3f}" for r, t in zip(rows_per_expert, times, strict=True))
        )
    return dict(hidden=hidden, ffn=ffn, curves=curves)


def _attention_ms(argv: list[str], case_name: str) -> float:
    """``bench attention``'s step time for one case, on the device's kernel backend."""
    args = attention_bench._parse(argv)
    args.dtype, args.dense_tflops = jnp.dtype(args.dtype), None
    backend = "pallas" if jax.default_backend() == "gpu" else "native"
    builders = dict(extend=attention_bench._extend_case, decode=attention_bench._decode_case)
    case = builders[case_name](args)
    configs = args.extend_configs if attention_bench._uses_extend_kernel(args, case) else None
    config = (configs or args.paged_configs)[0] if backend == "pallas" else None
    result, _ = attention_bench._run_case(args, case, backend, config)
    return result["step_ms"]


def _head_flags(kind: str, small: bool) -> list[str]:
    if small:
        return ["--small"] + (["--mla"] if kind == "mla" else [])
    if kind == "mla":
        return ["--mla", "--q-heads", "128"]
    return ["--q-heads", "56", "--kv-heads", "8", "--head-dim", "128"]


def attention(kind: str, extend_lens, extend_tokens: int, decode, small: bool) -> dict:
    """One attention kind's extend (ms per prompt by length) and decode (ms by KV rows read)."""
    flags = _head_flags(kind, small)
    per_seq = []
    for length in extend_lens:
        seqs = max(1, extend_tokens // length)
        argv = flags + ["--iters", "3", "--extend-tokens", str(seqs * length)]
        ms = _attention_ms(argv + ["--extend-seqs", str(seqs)], "extend")
        per_seq.append(ms / seqs)
    points = []
    for seqs, context in decode:
        argv = flags + [
            "--iters",
            "5",
            "--decode-seqs",
            str(seqs),
            "--decode-context",
            str(context),
        ]
        points.append((seqs, context, _attention_ms(argv, "decode")))
    _log(f"attention {kind}: extend {per_seq}, decode {points}")
    dims = vars(attention_bench._parse(flags))
    return dict(
        dims={name: dims[name] for name in ("q_heads", "kv_heads", "head_dim")},
        extend=dict(seq_len=list(extend_lens), ms_per_seq=per_seq),
        decode=dict(
            seqs=[p[0] for p in points], context=[p[1] for p in points], ms=[p[2] for p in points]
        ),
    )


def _small_attention_args(kind: str, small: bool) -> dict:
    """The ``--small`` attention sizes: ``bench attention --small`` fixes its own shapes."""
    if not small:
        decode = MLA_DECODE if kind == "mla" else GQA_DECODE
        return dict(extend_lens=MLA_EXTEND_LENS, extend_tokens=EXTEND_TOKENS, decode=decode)
    return dict(extend_lens=(128,), extend_tokens=256, decode=((16, 128),))


def rowwise(rows, hidden: int) -> dict:
    """Milliseconds of the row-wise operations at each row count (``hidden`` wide rows)."""

    def norm(x, w):
        scale = jax.lax.rsqrt((x.astype(jnp.float32) ** 2).mean(-1, keepdims=True) + 1e-6)
        return (x * scale * w).astype(x.dtype)

    def route(logits):
        return jax.lax.top_k(jax.nn.sigmoid(logits.astype(jnp.float32)), 8)

    out = dict(hidden=hidden, routing_experts=ROUTING_EXPERTS, rows=list(rows))
    out.update(rmsnorm=[], add=[], gather=[], routing=[])
    for m in rows:
        copies = _copies(4 * m * hidden)
        index = jnp.asarray(np.random.default_rng(0).permutation(m), jnp.int32)
        rows_of = lambda i, m=m: _normal(4 + i, (m, hidden))  # noqa: E731
        out["rmsnorm"].append(
            _ms_copies(norm, lambda i, rows_of=rows_of: (rows_of(i), _normal(6, (hidden,))), copies)
        )
        out["add"].append(
            _ms_copies(
                lambda x, y: x + y, lambda i, rows_of=rows_of: (rows_of(i), rows_of(i + 99)), copies
            )
        )
        out["gather"].append(
            _ms_copies(
                lambda x, j: x[j],
                lambda i, rows_of=rows_of, index=index: (rows_of(i), index),
                copies,
            )
        )
        logits = lambda i, m=m: (_normal(7 + i, (m, ROUTING_EXPERTS)),)  # noqa: E731
        out["routing"].append(_ms_copies(route, logits, copies))
    _log(f"rowwise: {out}")
    return out


def host_ms(reps: int = 50) -> float:
    """Median host round trip of one step: upload two small int32 buffers, call, read back."""
    step = jax.jit(lambda a, b: (a[:16] + b[:16]).sum())
    a, b = np.arange(4096, dtype=np.int32), np.arange(1024, dtype=np.int32)
    jax.device_get(step(jax.device_put(a), jax.device_put(b)))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.device_get(step(jax.device_put(a), jax.device_put(b)))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


MEASURED = (
    "slowdown", "host_ms", "rowwise", "dense_gemm", "grouped_gemm", "attention", "runner_host"
)  # fmt: skip
"""The sections ``measure`` takes, in the order it measures them."""
RUNNER_HOST_FLAGS = ("--devices", "1", "--attention-kind", "gqa", "--prefill", "4096",
                     "--decode", "128", "--no-profile")  # fmt: skip
"""``bench tbo``'s flags of the runner and cases ``runner_host`` times."""
RUNNER_HOST_SMALL = ("--devices", "1", "--tiny", "--attention-kind", "gqa", "--prefill", "64",
                     "--decode", "8", "--context", "16", "--no-profile")  # fmt: skip
"""The same with ``small``: the tiny model and cases, for a CPU run of the code."""
RUNNER_HOST_ITERS = 10
"""Timed steps of each of ``runner_host``'s plain and TBO steps (two with ``small``)."""


def runner_host(small: bool = False, iters: int = RUNNER_HOST_ITERS) -> dict:
    """The runner's host time per step (``bench tbo``'s runner and cases): for each mode, the
    medians of ``run_plan``'s inputs + dispatch phases of the plain and the TBO step, the two
    taking turns (``tbo.time_interleaved``).

    Returns:
      ``{"model", "devices", "method", "prefill": {"tokens", "plain_ms", "tbo_ms"}, "decode":
      {...}}``.
    """
    from jtbo.bench import tbo  # noqa: PLC0415  (builds runners: only this section needs it)

    args, config = tbo.parse(list(RUNNER_HOST_SMALL if small else RUNNER_HOST_FLAGS))
    (runner, *_), _ = tbo.bench_runners(args, config, auto=False)
    out = dict(
        model="tiny" if small else "deepseek_v3_gqa_reduced", devices=args.dp,
        method="ModelRunner.run_plan: last_step_phases inputs + dispatch (bench tbo's runner)",
    )  # fmt: skip
    for mode, size, batches in tbo.bench_cases(args, config.vocab_size):
        steps = [(runner, tbo.case_plan(runner, batches, on, args.logits)) for on in (False, True)]
        _, phases = tbo.time_interleaved(steps, 2 if small else iters)
        plain, with_tbo = ((p.inputs + p.dispatch) * 1e3 for p, _ in phases)
        out[mode] = dict(tokens=size, plain_ms=plain, tbo_ms=with_tbo)
    _log(f"runner_host: {out}")
    return out


def _torch_matmul_ms(torch, side=None, n: int = 8192, calls: int = 20) -> float:
    """Milliseconds per matmul on one stream while ``side()`` (if any) runs on another."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    main, other = torch.cuda.Stream(), torch.cuda.Stream()
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if side is not None:
            with torch.cuda.stream(other):
                side()
        with torch.cuda.stream(main):
            start.record()
            for _ in range(calls):
                torch.mm(a, b)
            end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def slowdown() -> dict:
    """Matmul time beside an exchange over matmul time alone: ``{"sm", "copy", "method"}``."""
    if not kernels.torch_usable():
        return dict(sm=1.0, copy=1.0, method="not measured (no torch GPU): 1.0")
    import torch  # noqa: PLC0415  (GPU machines only)

    src = torch.ones(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst, host = torch.empty_like(src), torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    alone = _torch_matmul_ms(torch)
    beside_sm = _torch_matmul_ms(torch, lambda: [dst.copy_(src) for _ in range(200)])
    beside_ce = _torch_matmul_ms(
        torch, lambda: [host.copy_(src, non_blocking=True) for _ in range(8)]
    )
    torch.cuda.synchronize()
    src = dst = host = None  # free before JAX takes more
    torch.cuda.empty_cache()
    method = "torch bf16 8192^3 matmuls on one stream beside 1 GiB copies on another"
    _log(f"slowdown: alone {alone:.3f} ms, beside D2D {beside_sm:.3f}, beside D2H {beside_ce:.3f}")
    return dict(sm=max(1.0, beside_sm / alone), copy=max(1.0, beside_ce / alone), method=method)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _log(line: str) -> None:
    print(f"[measure {time.strftime('%H:%M:%S')}] {line}", flush=True)


def _sections(grid: dict, small: bool) -> tuple:
    """``(name, measure it)`` of every section, in ``MEASURED``'s order."""
    return (
        ("slowdown", slowdown),
        ("host_ms", host_ms),
        ("rowwise", lambda: rowwise(grid["rowwise_rows"], grid["hidden"])),
        ("dense_gemm", lambda: dense_gemm(grid["dense_shapes"], grid["dense_rows"])),
        (
            "grouped_gemm",
            lambda: grouped(
                grid["expert_counts"], grid["rows_per_expert"], grid["hidden"], grid["ffn"]
            ),
        ),
        (
            "attention",
            lambda: {
                k: attention(k, **_small_attention_args(k, small), small=small)
                for k in ("mla", "gqa")
            },
        ),
        ("runner_host", lambda: runner_host(small)),
    )


def measure(small: bool = False, on_section=None, only=None, into=None) -> dict:
    """Measures the table's sections on the default device.

    Args:
      small: tiny grids, for a CPU run of the code.
      on_section: called with the table so far after each section (to save partial results).
      only: the names of the sections to measure (None: all, ``MEASURED``).
      into: a table whose other sections are kept (None: a new table); its ``date`` stays,
        and ``dates`` records when each section was measured.

    Returns:
      The table, as ``jtbo.analysis.step_costs`` reads it.

    Raises:
      ValueError: ``only`` names an unknown section, or ``into`` was measured with the other
        ``small`` or on another kind of device.
    """
    only = MEASURED if only is None else tuple(only)
    unknown = sorted(set(only) - set(MEASURED))
    if unknown:
        raise ValueError(f"unknown sections {unknown}; the table has {list(MEASURED)}")
    grid = SMALL if small else FULL
    device = jax.devices()[0]
    table = dict(into or {}, version=VERSION, kind="jtbo_step_costs", device=device.device_kind)
    table.update(platform=jax.default_backend(), jax=jax.__version__, dtype="bfloat16")
    if into is not None and into.get("small", small) != small:
        raise ValueError(f"the table to update has small={into['small']}, not {small}")
    if into is not None and into.get("device", device.device_kind) != device.device_kind:
        raise ValueError(f"the table to update is of a {into['device']}, not this device's "
                         f"{device.device_kind}")  # fmt: skip
    table.setdefault("date", _now())
    dates = dict(table.get("dates", {}))
    table["small"] = small
    sections = _sections(grid, small)
    for name, fn in sections:
        if name not in only:
            continue
        table[name] = fn()
        dates[name] = _now()
        table["dates"] = dates
        if on_section is not None:
            on_section(table)
    return table
