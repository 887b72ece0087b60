"""One routed-expert FFN layer three ways: ``python -m jtbo.bench grouped_gemm [flags]``.

``python -m jtbo.bench grouped_gemm [--tokens 128,256,4096,16384]
[--impls capacity,dense,pallas,ragged_dot,tokamax] [--capacity-factor 4] [--skew 0]
[--preset NAME | --hidden H --ffn F --experts E --top-k K] [--iters 20] [--reps 5]
[--expert-dtype float8_e4m3fn] [--kernel-time] [--layers-per-call N] [--xla-defaults]
[--small] [--no-copy-ceiling]``

Question: jtbo's routed experts run as a capacity-slot batched matmul
(``jtbo.models.experts.experts_capacity``) because ``jax.lax.ragged_dot`` ran far slower on
the H200 (docs/benchmarks/, "Grouped GEMM for the routed experts"). Could a Pallas grouped GEMM
(tokamax's ``ragged_dot``, Hopper kernel ``pallas_mosaic_gpu``) do better than the capacity
slots, which compute ``capacity_factor`` times the real work?

Method: DeepSeek-V3-reduced expert shapes by default (``MoEConfig.deepseek_v3_reduced()``:
H=7168, F=2048, E=64, top-8, bf16). ``--preset NAME`` takes a model family's published
routed-expert shape instead (``jtbo.bench.expert_presets``; ``--help`` lists the names). A
preset sets ``--hidden``, ``--ffn``, ``--experts`` and ``--top-k``, so giving one of those (or
``--small``) with it is a usage error naming both, never a silent mix of two shapes. Without
a preset each size flag left out takes the default model's size (``--small``'s tiny one with
``--small``). For each token count T the tokens get uniform random *distinct* experts
(``--skew S``: a fraction S of the tokens also picks expert 0) and random routing
weights; every impl runs the same assignment through one whole layer: gate, up,
``silu(gate) * up``, down, and the weighted sum over each token's k experts (the routing
bookkeeping, sort / scatter / gather, is timed with it, since each layout needs its own).

* ``capacity``: ``experts_capacity`` with ``capacity = ceil(--capacity-factor * T * k / E)``
  slots per expert (the EP capacity of the tbo bench); pairs past an expert's capacity are
  dropped (the ``dropped`` column; they show up in the error). It computes ``E * capacity``
  rows whatever the routing: ``computed TF/s`` counts those rows, ``useful TF/s`` the real ones
  (``mosaic`` rows count each expert's rows rounded up to whole row tiles: the padding its
  kernels compute; the other impls' count the pairs).
* ``pallas``: ``experts_capacity`` with ``impl="pallas"``: the same slots, but the grouped
  GEMM kernel (``jtbo.kernels.grouped_gemm``) computes only the filled ones (rows padded to
  its row block per expert), loading each slot's token row through the slots' row index
  (``kernels.SlotRows``) instead of a slot buffer. ``pallas:SPEC`` sets its launch shapes:
  ``SPEC`` is ``MxNxK[wW][sS][gG]`` for both kernels or ``GATE_UP/DOWN`` for each (block_m x
  block_n x block_k, warps, pipeline stages, row-tile group; omitted parts keep the
  defaults), e.g. ``pallas:128x64x64w8s3/128x128x64w8s3`` (a spec's row tiles follow the
  capacity: ``balanced_row_tiles`` off, as in the float default; the FP8 default has it on).
  With FP8 experts the kernels quantize the rows too (``fp8_activations``, the default);
  ``pallas:weight_only[:SPEC]`` runs them with float rows (weight-only FP8). Before timing,
  the kernel alone is checked on the first two experts' slots against
  ``grouped_ffn_reference`` (float32, exact count) and its padding slots must come out zero
  (a log line; a failure is an error row). Each ``pallas``
  row is followed by ``pallas (kernel)``: ``kernels.grouped_ffn`` alone on a slot buffer laid
  out beforehand, without the layer's slot index and its gather out of the slots
  (``--no-kernel-rows`` leaves these rows out, and their compiles).
* ``mosaic``: ``experts_capacity`` with ``impl="mosaic"``: the Hopper kernels (Pallas Mosaic
  GPU, ``jtbo.kernels.grouped_gemm_mosaic``) over the same filled slots, gathered into
  tile-major rows first; the layer reads its result through the rows' slot index.
  ``mosaic:SPEC`` sets their launch shapes: ``MxNxK[sS][tT][fF][p][c][rR]`` for both kernels
  or ``GATE_UP/DOWN`` (row tile x columns per CTA x contraction step, pipeline stages, row
  tiles walked together, steps whose ``wgmma`` stays in flight, ``p``: one pipeline over all
  of a CTA's tiles, the next tile's loads under the current tile's end, ``c``: with FP8
  experts the two warpgroups split the columns of an M-row tile, ``rR``: the memory
  warpgroup keeps R registers a thread), e.g. ``mosaic:128x128x64s4/128x256x64s4f1``. It is
  checked and followed by a ``mosaic (kernel)`` row as ``pallas`` is.
* ``dense``: the yardstick of the ``vs dense`` target, not a routed layer: one dense SwiGLU
  (``[T * k, H] @ [H, 2F]``, ``silu * up``, ``@ [F, H]``, bf16 hidden, float32 accumulate)
  over as many rows as the routed pairs, with one expert's weights. Its useful TF/s is the
  denominator of every row's ``vs dense``.
* ``ragged_dot``: ``experts_ragged_dot_reference`` (pairs sorted by expert,
  ``jax.lax.ragged_dot``, gate / up in float32).
* ``tokamax``: the same sorted rows through ``tokamax.ragged_dot(...,
  implementation="mosaic_gpu")`` (the ``pallas_mosaic_gpu`` kernels) with tokamax's own config
  choice (tokamax 0.0.17 ships no H200 autotuning cache, so on the H200 that is its sm90
  heuristic: 64 x 64 x 128 tiles, 2 stages). ``tokamax:h100`` passes the fastest configs of
  tokamax's H100 cache for DeepSeek-V3's expert shapes (``H100_CONFIGS``);
  ``tokamax:NAME`` runs ``implementation=NAME`` (e.g. ``triton``, ``xla``). tokamax's gate / up
  come out in bf16 (its tuned path; float32 outputs halve its tile width), so silu runs on
  bf16-rounded values: a small extra error.

Timing: each impl is one jitted function of (tokens, ids, routing weights, expert weights),
compiled on a GPU with the options a model step compiles with (``jit_as_step``: its kernels
recorded into one CUDA graph, as the layer runs inside a step; ``--xla-defaults``: XLA's
default options);
after ``--warmup`` calls, ``--reps`` batches of ``--iters`` calls are enqueued back to back and
waited for (``block_until_ready``); the table gives the median per-call time. A batch
carries a fixed cost besides its calls (the first call's dispatch before the GPU starts, the
wait at its end), which few calls per batch add to a decode-size layer's time per call
(docs/benchmarks/, "Grouped GEMM kernels at Qwen3-30B-A3B's expert shape"); the default of
20 keeps it near the steady rate at which a model step runs its layers back to back. The
impls of one T are timed in turns, one batch of each per rep
(``device_rates.time_fns_interleaved``): a GPU's clock falls within seconds of matmuls, so
impls timed one after the other would compare different clocks (docs/benchmarks/, "the clock
falls under load"). ``useful TF/s``
= 2 * 3 * T * k * H * F / time; ``time / capacity`` is the impl's time over ``capacity``'s at
the same T (< 1: faster); ``vs dense`` = the dense row's time over the impl's (its useful TF/s
as a fraction of dense; target >= 0.75 at 4096-16384 tokens). ``weight GB/s`` = the bytes of
the routed experts' weights (every expert that got a pair, 3 * H * F each) per second;
``of copy`` divides it by the device's copy bandwidth (read + write bytes per second of a
1 GiB ``torch`` ``copy_``, or of XLA's ``x + s`` without torch), measured once at the start
(target >= 0.85 at 128-256 tokens).

``--expert-dtype float8_e4m3fn`` stores the experts' weights as block-scaled FP8 (128 x 128 blocks,
``jtbo.kernels.fp8_blocks``; the tokens stay ``--dtype``): ``capacity`` dequantizes them to
``--dtype`` inside the layer, ``pallas`` and ``mosaic`` read them as FP8 in their kernels
(``mosaic`` with FP8 rows only), ``ragged_dot`` / ``tokamax`` dequantize them first; ``dense``
stays the ``--dtype`` yardstick (the first expert dequantized), and ``weight GB/s`` counts one byte
a weight. The layer's reference dequantizes them to float32, and for the impls that quantize their
rows (``capacity``, ``pallas``, ``mosaic``: ``fp8_rows``) it puts the rows and the hidden rows
through the same FP8 rounding, so ``rel err`` measures the kernels, not the FP8 rounding; the
kernel check compares against ``grouped_ffn_reference`` of the same scheme.

``--layers-per-call N`` times each layer row, and ``dense``, as ``N`` layers in one call, as a
model step runs its layers: each layer with its own routing (the first one the checked one),
all with the same expert weights (one layer's weights are far larger than the L2 cache, so
reading them again costs what reading another layer's would), each adding its output to the
rows it took, as a residual connection does; ``ms`` and the rates are per layer. A call's own
cost (its launch and the gap before its first kernel) is then paid once per ``N`` layers,
which at decode sizes is a visible part of a layer called alone. The ``(kernel)`` rows stay
one call each.

``--kernel-time`` traces ``--iters`` more calls of each timed row (after the timing, so the
table's times carry no profiler) and logs a line per row: the GPU time per call (per layer
with ``--layers-per-call``) of each of its kernels in microseconds
(``kernel_time.kernels_per_call``): where a layer's time goes between the grouped GEMM kernels
and the routing bookkeeping around them.

Numerics: ``rel err`` = ||out - ref|| / ||ref|| over
``--check-rows`` tokens spread evenly over the batch (a token's output depends on its own row
only), ``ref`` being ``experts_ragged_dot_reference`` in float32 at ``highest`` precision.

tokamax is optional and imported only when a ``tokamax*`` impl is asked for; a failing impl
(tokamax not importable, an unsupported kernel, ...) gets an ``error`` row and the run exits
non-zero after the table. Installing it (needs jax >= 0.11.1, Python >= 3.12): ``pip install
tokamax==0.0.17``. On a machine without a registry, carry the wheels and install them with
``--no-deps``: tokamax-0.0.17, einshape, pydantic, pydantic-core, annotated-types,
typing-inspection, typing-extensions >= 4.16 (pydantic-core imports ``Sentinel``), qwix,
immutabledict, xprof, fire, termcolor (``import tokamax`` imports xprof's kernel-stats tool,
which imports fire); jaxtyping, tqdm, absl-py, flax, six are needed too. tensorboardX is not
(only ``tokamax.benchmarks`` imports it). With those wheels in ``.whl/``: ``python3 -m pip
install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export
PYTHONPATH=/tmp/site:$PWD``.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import math
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import kernels
from jtbo.bench import device_rates, expert_presets, kernel_time, options, trace_calls
from jtbo.core import arith, cli_arguments
from jtbo.kernels import fp8_blocks, gemm_config, grouped_gemm
from jtbo.models import config as config_lib
from jtbo.models import experts, step


def jit_as_step(fn: Callable, xla_defaults: bool = False) -> Callable:
    """``fn`` jitted with the options a plain model step on one device compiles with
    (``step.step_compiler_options``: on a GPU the layer's kernels run as one CUDA graph, as
    inside a step; none elsewhere), or with XLA's defaults (``xla_defaults``)."""
    if xla_defaults:
        return jax.jit(fn)
    one_device = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("device",))
    return jax.jit(fn, compiler_options=step.step_compiler_options(one_device, None))


IMPLS = ("capacity", "dense", "pallas", "mosaic", "ragged_dot", "tokamax")
KERNEL_IMPLS = ("pallas", "mosaic")
"""The impls that are jtbo kernels: a kernel check first, an ``IMPL (kernel)`` row after."""
GIB = 1 << 30
TOKAMAX_WHEEL = "tokamax-0.0.17-py3-none-any.whl"
# tokamax 0.0.17 data/autotuning/nvidia_h100_80gb_hbm3/pallas_mosaic_gpu_ragged_dot.json: the
# fastest config for bf16[131072, 7168] x bf16[256, 7168, 1024] (gate / up: K = H) and for
# bf16[131072, 1024] x bf16[256, 1024, 7168] (down: N = H), keyed here by "K = H or not".
H100_CONFIGS = {
    "k_is_hidden": dict(
        block_m=128,
        block_n=64,
        block_k=128,
        num_stages=4,
        split_k=1,
        persistent=True,
        grid_minor_dim=1,
        grid_tile_width=8,
    ),
    "n_is_hidden": dict(
        block_m=128,
        block_n=64,
        block_k=128,
        num_stages=2,
        split_k=1,
        persistent=False,
        grid_minor_dim=0,
        grid_tile_width=1,
    ),
}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Expert-layer shapes.

    Attributes:
      hidden: H.
      ffn: F (one expert's hidden width).
      experts: E.
      top_k: experts per token.
    """

    hidden: int
    ffn: int
    experts: int
    top_k: int

    def useful_flops(self, num_tokens: int) -> float:
        """FLOPs of the real (token, expert) pairs: three matmuls of H x F each."""
        return 2.0 * 3 * num_tokens * self.top_k * self.hidden * self.ffn

    def slot_flops(self, rows: int) -> float:
        """FLOPs of ``rows`` expert rows (the slots a capacity layout computes)."""
        return 2.0 * 3 * rows * self.hidden * self.ffn

    def weight_bytes(self, num_experts: int, itemsize: int) -> float:
        """Bytes of ``num_experts`` experts' gate, up and down weights."""
        return 3.0 * num_experts * self.hidden * self.ffn * itemsize


SMALL_SHAPES = Shapes(hidden=64, ffn=32, experts=8, top_k=2)
"""The expert shape of ``--small`` (a CPU smoke run)."""
_POSITIVE = cli_arguments.positive_int
_SIZE_DEFAULT = "(default: DeepSeek-V3-reduced's; --small's with --small)"


@dataclasses.dataclass(frozen=True)
class ShapeOptions:
    """The expert shape's flags: a preset, or sizes (``resolve_shapes``).

    A size left out takes ``MoEConfig.deepseek_v3_reduced()``'s, or ``SMALL_SHAPES``'s with
    ``--small``.
    """

    preset: str | None = options.option(
        None, choices=sorted(expert_presets.PRESETS), metavar="NAME",
        help="a model family's routed-expert shape: "
        f"{', '.join(expert_presets.PRESETS)} (sets --hidden --ffn --experts --top-k; giving "
        "one of those or --small too is an error)",
    )  # fmt: skip
    hidden: int | None = options.option(None, type=_POSITIVE, help=f"H {_SIZE_DEFAULT}")
    ffn: int | None = options.option(None, type=_POSITIVE, help=f"F, per expert {_SIZE_DEFAULT}")
    experts: int | None = options.option(None, type=_POSITIVE, help=f"E {_SIZE_DEFAULT}")
    top_k: int | None = options.option(
        None, type=_POSITIVE, help=f"experts per token {_SIZE_DEFAULT}"
    )


def resolve_shapes(flags: ShapeOptions, small: bool) -> Shapes:
    """The expert shape the flags ask for.

    Args:
      flags: the parsed shape flags.
      small: ``--small``: the sizes not given default to ``SMALL_SHAPES``.

    Returns:
      The preset's shape, else each size given, the others from ``SMALL_SHAPES`` with
      ``small`` or from ``MoEConfig.deepseek_v3_reduced()`` without.

    Raises:
      ValueError: a preset given together with a size flag or ``small`` (naming both).
    """
    sizes = {name: value for name, value in dataclasses.asdict(flags).items() if name != "preset"}
    given = {name: value for name, value in sizes.items() if value is not None}
    if flags.preset is not None:
        clash = ["--" + name.replace("_", "-") for name in given] + (["--small"] if small else [])
        if clash:
            raise ValueError(
                f"--preset {flags.preset} sets the expert shape, and {' '.join(clash)} would "
                "change it: give the preset or the sizes, not both"
            )
        return Shapes(**expert_presets.PRESETS[flags.preset].shape_flags())
    if small:
        return dataclasses.replace(SMALL_SHAPES, **given)
    cfg = config_lib.MoEConfig.deepseek_v3_reduced()
    default = Shapes(
        cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    )
    return dataclasses.replace(default, **given)


def route(num_tokens: int, shapes: Shapes, skew: float, seed: int) -> tuple[np.ndarray, ...]:
    """Random routing: ``(ids [T, k] int32 distinct per token, weights [T, k] float32)``.

    A fraction ``skew`` of the tokens (chosen at random) also routes to expert 0.
    """
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((num_tokens, shapes.experts)), axis=1)[:, : shapes.top_k]
    for t in np.flatnonzero(rng.random(num_tokens) < skew):
        row = ids[t]
        if 0 not in row:
            row[0] = 0
    weights = rng.random((num_tokens, shapes.top_k)).astype(np.float32) + 0.1
    weights /= weights.sum(axis=1, keepdims=True)
    return ids.astype(np.int32), weights


def capacity_for(num_tokens: int, shapes: Shapes, factor: float) -> int:
    """Slots per expert: ``factor`` x the balanced load ``T * k / E`` (at least 1)."""
    return max(1, math.ceil(factor * num_tokens * shapes.top_k / shapes.experts))


def computed_rows(impl: str, ids: np.ndarray, shapes: Shapes, capacity: int, fp8: bool) -> int:
    """Rows ``impl`` computes for the pairs ``ids [T, k]`` over ``shapes.experts`` experts:
    every expert's ``capacity`` slots (``capacity``), each expert's filled slots rounded up to
    whole row tiles (``mosaic``, its gate / up kernel's ``block_m``; ``fp8``: with FP8
    experts), else the pairs."""
    num_experts = shapes.experts
    if impl == "capacity":
        return num_experts * capacity
    name, _, variant = impl.partition(":")
    if name != "mosaic":
        return ids.size
    default = gemm_config.default_mosaic_ffn(shapes.hidden, shapes.ffn, fp8, ids.size / num_experts)
    cfg = (kernel_config(name, variant) or default).gate_up
    counts = np.minimum(np.bincount(ids.reshape(-1), minlength=num_experts), capacity)
    return int(np.sum(arith.ceil_div(counts, cfg.block_m)) * cfg.block_m)


def dropped_pairs(ids: np.ndarray, num_experts: int, capacity: int) -> int:
    """Pairs past their expert's capacity (what ``experts_capacity`` drops)."""
    loads = np.bincount(ids.reshape(-1), minlength=num_experts)
    return int(np.maximum(loads - capacity, 0).sum())


def import_tokamax():
    """``tokamax``, or ImportError saying which wheel to install."""
    try:
        import tokamax  # noqa: PLC0415  (optional: GPU benchmark only)
    except ImportError as e:
        raise ImportError(
            f"tokamax is not importable ({type(e).__name__}: {e}); install {TOKAMAX_WHEEL} "
            "(pip install tokamax==0.0.17, or the carried wheels with --no-deps: see "
            "python -m jtbo.bench grouped_gemm --help)"
        ) from e
    return tokamax


def tokamax_dot(variant: str, hidden: int):
    """The grouped GEMM of a ``tokamax[:variant]`` impl, as ``experts.experts_sorted`` calls it.

    Args:
      variant: ``""`` (implementation ``mosaic_gpu``, its own config), ``"h100"`` (mosaic_gpu
        with ``H100_CONFIGS``) or a tokamax implementation name.
      hidden: H (picks the H100 config: contraction over H or output of width H).
    """
    tokamax = import_tokamax()
    if variant != "h100":
        implementation = variant or "mosaic_gpu"

        def dot(lhs, rhs, sizes, out_dtype):
            del out_dtype  # tokamax's tuned path: outputs in the input dtype (bf16)
            return tokamax.ragged_dot(lhs, rhs, sizes, implementation=implementation)

        return dot
    from tokamax._src.ops.ragged_dot import api  # noqa: PLC0415
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common  # noqa: PLC0415

    ops = {
        key: api.IMPLEMENTATIONS["mosaic_gpu"].replace(
            config=common.Config(
                **{**cfg, "grid_minor_dim": common.MatmulDimension(cfg["grid_minor_dim"])}
            )
        )
        for key, cfg in H100_CONFIGS.items()
    }

    def dot(lhs, rhs, sizes, out_dtype):
        del out_dtype
        op = ops["k_is_hidden" if rhs.shape[1] == hidden else "n_is_hidden"]
        return tokamax.ragged_dot(lhs, rhs, sizes, implementation=(op,))

    return dot


_GEMM_SPEC = re.compile(r"(\d+)x(\d+)x(\d+)(?:w(\d+))?(?:s(\d+))?(?:g(\d+))?")


def parse_gemm_config(spec: str) -> kernels.GemmConfig:
    """``MxNxK[wW][sS][gG]`` -> ``GemmConfig`` (omitted parts keep the defaults).

    Raises:
      ValueError: a spec that does not match, or values ``GemmConfig`` rejects.
    """
    match = _GEMM_SPEC.fullmatch(spec)
    if match is None:
        raise ValueError(f"gemm config {spec!r}: expected MxNxK[wW][sS][gG], e.g. 64x128x64w4s4")
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")
    return kernels.GemmConfig(
        **{name: int(v) for name, v in zip(names, match.groups(), strict=True) if v is not None}
    )


def _two_kernels(variant: str, parse, make):
    """``make(gate_up=..., down=...)`` of ``GATE_UP[/DOWN]`` (one spec: both), None for ``""``."""
    if not variant:
        return None
    gate_up, _, down = variant.partition("/")
    return make(gate_up=parse(gate_up), down=parse(down or gate_up))


def pallas_config(variant: str) -> kernels.GroupedFfnConfig | None:
    """The ``GroupedFfnConfig`` of ``pallas:VARIANT`` (None for the default)."""
    return _two_kernels(variant, parse_gemm_config, kernels.GroupedFfnConfig)


_MOSAIC_SPEC = re.compile(r"(\d+)x(\d+)x(\d+)(?:s(\d+))?(?:t(\d+))?(?:f(\d+))?(p)?(c)?(?:r(\d+))?")


def parse_mosaic_config(spec: str) -> kernels.MosaicGemmConfig:
    """``MxNxK[sS][tT][fF][p][c][rR]`` -> ``MosaicGemmConfig``: M x N a CTA's tile (two
    warpgroups of M / 2 rows each, or with ``c`` of N / 2 columns each, the FP8 kernels'
    ``split_columns``), K the contraction step, S the pipeline stages, T the row tiles walked
    together, F the steps' ``wgmma`` left in flight, ``p`` the pipeline prefetches across
    tiles, R the memory warpgroup's registers (omitted parts keep the defaults).

    Raises:
      ValueError: a spec that does not match (a letter not listed among them), or values
        ``MosaicGemmConfig`` rejects.
    """
    match = _MOSAIC_SPEC.fullmatch(spec)
    split = match is not None and match.group(8) is not None
    if match is None or int(match.group(2 if split else 1)) % 2:
        raise ValueError(
            f"mosaic config {spec!r}: expected MxNxK[sS][tT][fF][p][c][rR] with M even (N "
            "with c), e.g. 128x256x64s4"
        )
    block_m, block_n, tile_k, stages, width, in_flight, prefetch, _, registers = match.groups()
    fields = dict(split_columns=split, tile_k=int(tile_k))
    if split:  # the warpgroups side by side: each all M rows and half the N columns
        fields.update(tile_m=int(block_m), tile_n=int(block_n) // 2)
    else:
        fields.update(tile_m=int(block_m) // 2, tile_n=int(block_n))
    fields.update({} if stages is None else {"max_concurrent_steps": int(stages)})
    fields.update({} if width is None else {"grid_tile_width": int(width)})
    fields.update({} if in_flight is None else {"wgmma_in_flight": int(in_flight)})
    fields.update({} if prefetch is None else {"prefetch_across_tiles": True})
    fields.update({} if registers is None else {"memory_registers": int(registers)})
    return kernels.MosaicGemmConfig(**fields)


def mosaic_config(variant: str) -> kernels.MosaicFfnConfig | None:
    """The ``MosaicFfnConfig`` of ``mosaic:VARIANT`` (None for the default)."""
    return _two_kernels(variant, parse_mosaic_config, kernels.MosaicFfnConfig)


WEIGHT_ONLY = "weight_only"
"""``pallas:weight_only[:SPEC]``: FP8 experts with float rows (``fp8_activations=False``)."""


def kernel_variant(variant: str) -> tuple[str, bool]:
    """``(launch-shape spec, fp8_activations)`` of a kernel impl's ``VARIANT``."""
    if variant == WEIGHT_ONLY or variant.startswith(WEIGHT_ONLY + ":"):
        return variant.removeprefix(WEIGHT_ONLY).removeprefix(":"), False
    return variant, True


def kernel_config(name: str, variant: str):
    """The launch shapes of ``NAME:VARIANT`` for a kernel impl (``KERNEL_IMPLS``)."""
    spec, _ = kernel_variant(variant)
    return pallas_config(spec) if name == "pallas" else mosaic_config(spec)


def fp8_rows(impl: str) -> bool:
    """Whether ``impl``'s layer quantizes its rows with FP8 experts: ``capacity`` and the
    kernel impls (but ``weight_only`` variants) do; the sorted ones dequantize the weights."""
    name, _, variant = impl.partition(":")
    return impl == "capacity" or (name in KERNEL_IMPLS and kernel_variant(variant)[1])


def kernel_options(name: str, variant: str) -> dict:
    """The kernel impl's keywords for the slot FFN: impl, launch shapes, FP8 scheme."""
    _, fp8_activations = kernel_variant(variant)
    config = kernel_config(name, variant)
    return dict(impl=name, config=config, fp8_activations=fp8_activations)


def dense_layer(x_rows, w_gate_up, w_down) -> jax.Array:
    """The dense yardstick: one SwiGLU over ``x_rows [M, H]`` with ``[H, 2, F]``, ``[F, H]``."""
    f32 = jnp.float32
    gate_up = jnp.einsum("mh,hsf->msf", x_rows, w_gate_up, preferred_element_type=f32)
    hidden = (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]).astype(x_rows.dtype)
    return jnp.dot(hidden, w_down, preferred_element_type=f32).astype(x_rows.dtype)


def layer_fn(impl: str, shapes: Shapes, capacity: int, xla_defaults: bool = False):
    """The jitted layer ``(x, ids, routing weights, expert weights) -> [T, H]`` of ``impl``
    (``jit_as_step``)."""
    return jit_as_step(layer_body(impl, shapes, capacity), xla_defaults)


def stacked(layer: Callable) -> Callable:
    """``layer(x, ids, routing, weights)`` as a stack: ``(x, ids [N, T, k], routing [N, T, k],
    weights) -> [T, H]``, layer ``i`` with routing ``i``, each adding its output to its input
    rows (``--layers-per-call``)."""

    def stack(x, layer_ids, layer_routing, weights):
        for ids, routing in zip(layer_ids, layer_routing, strict=True):
            x = x + layer(x, ids, routing, weights)
        return x

    return stack


def dense_stack(layers: int) -> Callable:
    """``dense_layer`` ``layers`` times in one call, each adding its output to its rows."""

    def stack(x_rows, w_gate_up, w_down):
        for _ in range(layers):
            x_rows = x_rows + dense_layer(x_rows, w_gate_up, w_down)
        return x_rows

    return stack


def layer_body(impl: str, shapes: Shapes, capacity: int) -> Callable:
    """The layer ``(x, ids, routing weights, expert weights) -> [T, H]`` of ``impl``, not
    jitted."""
    if impl == "capacity":
        return functools.partial(experts.experts_capacity, capacity=capacity)
    name, _, variant = impl.partition(":")
    if name in KERNEL_IMPLS:
        return functools.partial(
            experts.experts_capacity, capacity=capacity, **kernel_options(name, variant)
        )
    if impl == "ragged_dot":
        return experts.experts_ragged_dot_reference
    if name == "tokamax":
        dot = tokamax_dot(variant, shapes.hidden)
        return functools.partial(
            experts.experts_sorted, grouped_dot=dot, hidden_dtype=None, out_dtype=None
        )
    raise ValueError(
        f"unknown impl {impl!r}; expected one of {IMPLS}, pallas:SPEC, mosaic:SPEC or "
        "tokamax:VARIANT"
    )


def check_rows(num_tokens: int, count: int) -> np.ndarray:
    """``count`` token indices spread evenly over ``[0, T)`` (all when T <= count)."""
    return np.unique(np.linspace(0, num_tokens - 1, min(count, num_tokens)).astype(np.int32))


REFERENCE_CHUNK = 8
"""Checked rows per reference call: only the experts those rows route to are cast to float32,
so that a model with many large experts (DeepSeek-V3's 256) never holds all of them in float32."""


def reference(x, ids, routing, weights, rows, activation_groups=None) -> jax.Array:
    """float32 ``experts_ragged_dot_reference`` on ``rows`` at ``highest`` precision, in chunks
    of ``REFERENCE_CHUNK`` rows over the experts each chunk uses (ids renumbered to them; FP8
    weights dequantized to float32; ``activation_groups``: FP8 rows, as the reference's)."""
    num_experts, top_k = jax.tree.leaves(weights)[0].shape[0], ids.shape[1]
    # Every chunk takes the same number of experts (its own, then repeats of its first), so
    # one compiled program serves them all: run op by op, the chunks took over a minute.
    used_per_chunk = min(num_experts, REFERENCE_CHUNK * top_k)
    outs = []
    for start in range(0, len(rows), REFERENCE_CHUNK):
        part = rows[start : start + REFERENCE_CHUNK]
        used, local = np.unique(np.asarray(ids[part]), return_inverse=True)
        used = np.pad(used, (0, used_per_chunk - len(used)), mode="edge")
        local_ids = jnp.asarray(local.reshape(ids[part].shape), ids.dtype)
        outs.append(
            _reference_chunk(
                x[part], local_ids, routing[part], tuple(weights), jnp.asarray(used),
                activation_groups,
            )
        )  # fmt: skip
    return jnp.concatenate(outs)


@functools.partial(jax.jit, static_argnums=5)
def _reference_chunk(x, local_ids, routing, weights, used, activation_groups) -> jax.Array:
    """One chunk of ``reference``: ``x [C, H]`` routed by ``local_ids [C, k]`` into the
    experts ``used [U]`` (in float32, at ``highest`` precision)."""
    chosen = jax.tree.map(lambda a: a[used], weights)
    f32 = tuple(w.astype(jnp.float32) for w in experts.float_weights(chosen, jnp.float32))
    with jax.default_matmul_precision("highest"):
        return experts.experts_ragged_dot_reference(
            x.astype(jnp.float32), local_ids, routing, f32, activation_groups
        )


def rel_error(out: jax.Array, ref: jax.Array) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, float32)."""
    diff = np.asarray(out, np.float32) - np.asarray(ref, np.float32)
    return float(np.linalg.norm(diff) / max(np.linalg.norm(np.asarray(ref, np.float32)), 1e-30))


def make_inputs(
    num_tokens: int, shapes: Shapes, dtype, key, expert_dtype: str | None = None
) -> tuple[jax.Array, tuple]:
    """``(x [T, H], (w_gate_up [E, H, 2, F], w_down [E, F, H]))``: normal, weights scaled by
    1/sqrt(fan-in); in ``dtype``, or block-scaled FP8 for ``expert_dtype="float8_e4m3fn"``
    (``fp8_blocks.BlockQuantized`` of float32 draws, 128 x 128 blocks, stored
    contraction-last as the model stores them: ``fp8_blocks.expert_axes``). The weights are
    drawn in float32 and converted ``DRAW_EXPERTS`` experts at a time."""
    k_x, k_gu, k_d = jax.random.split(key, 3)
    e, h, f = shapes.experts, shapes.hidden, shapes.ffn
    x = jax.random.normal(k_x, (num_tokens, h), dtype)
    if expert_dtype is not None:
        convert = fp8_blocks.quantize_experts
    else:
        convert = functools.partial(jnp.asarray, dtype=dtype)
    return x, (
        _drawn_weight(k_gu, (e, h, 2, f), h, convert),
        _drawn_weight(k_d, (e, f, h), f, convert),
    )


# Experts whose weights make_inputs draws at once in float32: DeepSeek-V3's 256 experts'
# gate / up draws alone take 28 GiB, past an H100's share for XLA beside the layer's weights.
DRAW_EXPERTS = 32


def _drawn_weight(key, shape: tuple[int, ...], fan_in: int, convert):
    """A stacked expert weight of ``shape``, normal over ``sqrt(fan_in)``, each draw of
    ``DRAW_EXPERTS`` experts converted by ``convert`` (a dtype cast or the FP8 block
    quantization) before the next is drawn (``make_inputs``)."""
    parts = []
    for first in range(0, shape[0], DRAW_EXPERTS):
        experts = min(DRAW_EXPERTS, shape[0] - first)
        draw = jax.random.normal(jax.random.fold_in(key, first), (experts, *shape[1:]))
        parts.append(convert(draw / math.sqrt(fan_in)))
        del draw  # the float32 draw goes before the next one is made
    return jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *parts)


def weight_itemsize(args) -> int:
    """Bytes a routed-expert weight takes: ``--expert-dtype``'s, else ``--dtype``'s."""
    return jnp.dtype(args.expert_dtype or args.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row; ``error`` set (and the numbers None) when the impl failed."""

    tokens: int
    impl: str
    capacity: int | None
    dropped: int | None
    seconds: float | None = None
    useful_flops: float = 0.0
    computed_flops: float = 0.0
    rel_err: float | None = None
    weight_bytes: float = 0.0
    error: str | None = None


TABLE_HEAD = (
    "| T | impl | capacity / expert | dropped pairs | ms | useful TF/s | computed TF/s "
    "| time / capacity | rel err | vs dense | weight GB/s | of copy |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
)


def _ratio(numerator: float | None, denominator: float | None) -> str:
    if not (numerator and denominator):
        return "-"
    ratio = numerator / denominator
    # Tiny ratios (CPU smoke runs) keep a significant digit instead of printing 0.00.
    return f"{ratio:.2f}" if ratio >= 0.005 else f"{ratio:.1e}"


def format_row(
    row: Row,
    capacity_seconds: float | None,
    dense_seconds: float | None = None,
    copy_gbs: float | None = None,
) -> str:
    """The markdown line of ``row``."""
    cap = "-" if row.capacity is None else str(row.capacity)
    dropped = "-" if row.dropped is None else str(row.dropped)
    if row.error is not None:
        lead = f"| {row.tokens} | {row.impl} | {cap} | {dropped} |"
        return f"{lead} error: {row.error} | - | - | - | - | - | - | - |"
    err = "-" if row.rel_err is None else f"{row.rel_err:.2e}"
    weight_gbs = row.weight_bytes / row.seconds / 1e9 if row.weight_bytes else None
    return (
        f"| {row.tokens} | {row.impl} | {cap} | {dropped} | {row.seconds * 1e3:.3f} | "
        f"{row.useful_flops / row.seconds / 1e12:.4g} | "
        f"{row.computed_flops / row.seconds / 1e12:.4g} | "
        f"{_ratio(row.seconds, capacity_seconds)} | {err} | "
        f"{_ratio(dense_seconds, row.seconds)} | "
        f"{'-' if weight_gbs is None else f'{weight_gbs:.4g}'} | {_ratio(weight_gbs, copy_gbs)} |"
    )


_START = time.perf_counter()


def _log(line: str) -> None:
    print(f"{line}  [{time.perf_counter() - _START:.0f}s]", flush=True)


# One compiled reference per shape for every impl and token count that checks its kernel.
_kernel_reference = jax.jit(grouped_gemm.grouped_ffn_reference, static_argnames="fp8_activations")


def check_kernel(name: str, variant: str, x, ids_np, weights, capacity: int) -> float:
    """The kernel alone on the first two experts' slots: rel err vs ``grouped_ffn_reference``.

    Raises:
      AssertionError: a padding slot (past its expert's count) is not zero.
    """
    counts = np.minimum(np.bincount(ids_np.reshape(-1), minlength=2)[:2], capacity)
    slots = jax.random.normal(jax.random.key(1), (2, capacity, x.shape[1]), x.dtype)
    w2 = jax.tree.map(lambda w: w[:2], weights)  # values and FP8 scales alike
    counts_arr = jnp.asarray(counts, jnp.int32)
    options = kernel_options(name, variant)
    fn = jax.jit(functools.partial(kernels.grouped_ffn, **options))
    out = np.asarray(fn(slots, counts_arr, *w2), np.float32)
    with jax.default_matmul_precision("highest"):
        ref = _kernel_reference(slots, counts_arr, *w2, fp8_activations=options["fp8_activations"])
    for e, count in enumerate(counts):
        if out[e, count:].any():
            raise AssertionError(f"expert {e}: slots past its count {count} are not zero")
    return rel_error(out, ref)


@functools.partial(jax.jit, static_argnums=(2, 3))
def slot_inputs(x, ids, num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """``(x_slots [E, C, H], counts [E])`` laid out as ``experts_capacity`` lays them."""
    position = experts.slot_positions(ids, num_experts)
    expert = jnp.where(position < capacity, ids, num_experts)  # past capacity: dropped
    token = jnp.broadcast_to(jnp.arange(x.shape[0])[:, None], ids.shape)
    slots = jnp.zeros((num_experts, capacity, x.shape[1]), x.dtype)
    slots = slots.at[expert, position].set(x[token], mode="drop")
    counts = jnp.minimum(jnp.bincount(ids.reshape(-1), length=num_experts), capacity)
    return slots, counts.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Pending:
    """A row whose impl ran and passed its checks, to be timed with the others of its T."""

    row: Row  # every field but ``seconds``
    fn: Callable  # the jitted function timed
    args: tuple  # its arguments
    layers: int = 1  # layers one call of ``fn`` runs (``seconds`` is per layer)


def kernel_row(impl, num_tokens, shapes, capacity, inputs, args) -> Pending:
    """``IMPL (kernel)``: the grouped FFN alone on ready slots (no routing bookkeeping); the
    ``"mosaic"`` impl's result stays in its tile-major rows (``grouped_ffn_rows``)."""
    x, ids_np, ids, _, weights, _, _, _ = inputs
    slots, counts = slot_inputs(x, ids, shapes.experts, capacity)
    pairs = num_tokens * shapes.top_k
    name, _, variant = impl.partition(":")
    rows_computed = computed_rows(impl, ids_np, shapes, capacity, args.expert_dtype is not None)
    fn = jit_as_step(
        functools.partial(
            grouped_gemm.grouped_ffn_rows, **kernel_options(name, variant),
            max_rows=min(shapes.experts * capacity, pairs),
        ),
        args.xla_defaults,
    )  # fmt: skip
    row = Row(
        tokens=num_tokens, impl=f"{impl} (kernel)", capacity=None, dropped=None,
        useful_flops=shapes.useful_flops(num_tokens),
        computed_flops=shapes.slot_flops(rows_computed),
        weight_bytes=shapes.weight_bytes(len(np.unique(ids_np)), weight_itemsize(args)),
    )  # fmt: skip
    return Pending(row, fn, (slots, counts, *weights))


def _prepare(impl, num_tokens, shapes, capacity, inputs, args) -> Row | Pending:
    """Runs and checks one impl; an error row for any failure, else its pending timing."""
    x, ids_np, ids, routing, weights, rows, refs, layer_routes = inputs
    is_cap = impl == "capacity"
    base = dict(
        tokens=num_tokens,
        impl=impl,
        capacity=capacity if is_cap else None,
        dropped=dropped_pairs(ids_np, shapes.experts, capacity) if is_cap else None,
    )
    pairs = num_tokens * shapes.top_k
    itemsize = weight_itemsize(args)
    try:
        if impl == "dense":
            first = experts.float_weights(jax.tree.map(lambda w: w[:1], weights), x.dtype)
            dense_args = (jnp.tile(x, (shapes.top_k, 1)), first[0][0], first[1][0])
            row = Row(
                **base, useful_flops=shapes.useful_flops(num_tokens),
                computed_flops=shapes.slot_flops(pairs),
                weight_bytes=shapes.weight_bytes(1, x.dtype.itemsize),
            )  # fmt: skip
            layers = args.layers_per_call
            dense = dense_layer if layers == 1 else dense_stack(layers)
            return Pending(row, jit_as_step(dense, args.xla_defaults), dense_args, layers)
        name, _, variant = impl.partition(":")
        if name in KERNEL_IMPLS:
            kernel_err = check_kernel(name, variant, x, ids_np, weights, capacity)
            _log(f"{impl} T={num_tokens}: kernel alone vs grouped_ffn_reference {kernel_err:.2e}")
        fn = layer_fn(impl, shapes, capacity, args.xla_defaults)
        ref = refs[fp8_rows(impl) and len(refs) > 1]
        err = rel_error(np.asarray(fn(x, ids, routing, weights))[rows], ref)
        rows_computed = computed_rows(impl, ids_np, shapes, capacity, args.expert_dtype is not None)
        touched = shapes.experts if is_cap else len(np.unique(ids_np))
        row = Row(
            **base,
            useful_flops=shapes.useful_flops(num_tokens),
            computed_flops=shapes.slot_flops(rows_computed),
            rel_err=err,
            weight_bytes=shapes.weight_bytes(touched, itemsize),
        )
        if args.layers_per_call == 1:
            return Pending(row, fn, (x, ids, routing, weights))
        stack = jit_as_step(stacked(layer_body(impl, shapes, capacity)), args.xla_defaults)
        return Pending(row, stack, (x, *layer_routes, weights), args.layers_per_call)
    except Exception as e:  # noqa: BLE001  (reported as an error row, never skipped)
        return Row(**base, error=_error_text(e))


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


def timed(prepared: list[Row | Pending], args) -> list[Row]:
    """The rows of ``prepared``, the pending ones timed in turns
    (``device_rates.time_fns_interleaved``); a failure while timing makes them error rows."""
    pending = [p for p in prepared if isinstance(p, Pending)]
    try:
        for p in pending:  # where a run's time goes: compiles (the table times none)
            start = time.perf_counter()
            jax.block_until_ready(p.fn(*p.args))
            _log(f"T={p.row.tokens} {p.row.impl}: first call {time.perf_counter() - start:.1f} s")
        seconds = device_rates.time_fns_interleaved(
            [(p.fn, p.args) for p in pending], warmup=args.warmup, iters=args.iters,
            reps=args.reps,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001  (reported as error rows, never skipped)
        failed = {id(p): dataclasses.replace(p.row, error=_error_text(e)) for p in pending}
        return [failed.get(id(p), p) for p in prepared]
    done = {
        id(p): dataclasses.replace(p.row, seconds=t / p.layers)
        for p, t in zip(pending, seconds, strict=True)
    }
    return [done.get(id(p), p) for p in prepared]


def measure(num_tokens: int, impls: list[str], shapes: Shapes, args) -> list[Row]:
    """Rows of every impl at ``num_tokens`` tokens (same routing and inputs for all), timed
    in turns so that their ratios compare one GPU state."""
    ids_np, routing_np = route(num_tokens, shapes, args.skew, args.seed + num_tokens)
    x, weights = make_inputs(
        num_tokens, shapes, jnp.dtype(args.dtype), jax.random.key(args.seed), args.expert_dtype
    )
    ids, routing = jnp.asarray(ids_np), jnp.asarray(routing_np)
    rows = check_rows(num_tokens, args.check_rows)
    refs = {False: reference(x, ids, routing, weights, rows)}  # by FP8 rows (fp8_rows)
    if args.expert_dtype is not None and any(map(fp8_rows, impls)):
        groups = (fp8_blocks.DEFAULT_BLOCK[0],) * 2
        refs[True] = reference(x, ids, routing, weights, rows, groups)
    capacity = capacity_for(num_tokens, shapes, args.capacity_factor)
    inputs = (x, ids_np, ids, routing, weights, rows, refs, layer_routes(ids, routing, args))
    prepared = []
    for impl in impls:
        row = _prepare(impl, num_tokens, shapes, capacity, inputs, args)
        prepared.append(row)
        kernel = impl.partition(":")[0] in KERNEL_IMPLS and isinstance(row, Pending)
        if kernel and args.kernel_rows:
            prepared.append(kernel_row(impl, num_tokens, shapes, capacity, inputs, args))
    out_rows = timed(prepared, args)
    for row in out_rows:
        _log(format_row(row, None))
    if args.kernel_time:
        log_kernel_times(prepared, args.iters)
    return out_rows


def layer_routes(ids, routing, args) -> tuple[jax.Array, jax.Array]:
    """``([N, T, k] ids, [N, T, k] routing weights)`` of ``--layers-per-call`` N layers: the
    first the checked layer's, each other drawn with its own seed."""
    num_tokens = ids.shape[0]
    # The first layer's seed is measure()'s; a prime stride keeps the others apart from it
    # and from the seeds of other token counts.
    more = [
        route(num_tokens, args.shapes, args.skew, args.seed + num_tokens + layer * 7919)
        for layer in range(1, args.layers_per_call)
    ]
    layer_ids = jnp.stack([ids, *(jnp.asarray(i) for i, _ in more)])
    layer_routing = jnp.stack([routing, *(jnp.asarray(r) for _, r in more)])
    return layer_ids, layer_routing


def log_kernel_times(prepared: list[Row | Pending], calls: int) -> None:
    """Logs each pending row's kernels per layer (``kernel_time.kernels_per_call``; a call of
    a ``--layers-per-call`` stack counts as that many) from a trace of ``calls`` more calls."""
    for p in prepared:
        if isinstance(p, Pending):
            kernels = trace_calls.trace_kernels(functools.partial(p.fn, *p.args), calls)
            line = kernel_time.kernels_per_call(kernels, calls * p.layers)
            _log(f"T={p.row.tokens} {p.row.impl}: {line}")


def _add_timing_flags(p: argparse.ArgumentParser) -> None:
    """How the rows are timed: warm-up calls, batches of calls, layers a call."""
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--iters", type=cli_arguments.positive_int, default=20, help="calls per timed batch"
    )
    p.add_argument(
        "--reps", type=cli_arguments.positive_int, default=5, help="timed batches (median)"
    )
    p.add_argument(
        "--layers-per-call",
        type=cli_arguments.positive_int,
        default=1,
        help="time the layer rows and dense as N layers a call, each its own routing (per layer)",
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    """The flags, with ``args.shapes`` resolved (``parser.error``: exit status 2 with the
    reason)."""
    p = argparse.ArgumentParser(
        prog="python -m jtbo.bench grouped_gemm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", default="128,256,4096,16384", help="comma list of T")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list; tokamax:VARIANT too")
    p.add_argument("--capacity-factor", type=float, default=4.0)
    p.add_argument("--skew", type=float, default=0.0, help="fraction of tokens also on expert 0")
    options.add_arguments(p, ShapeOptions)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--expert-dtype",
        choices=("float8_e4m3fn",),
        help="the experts' weights as block-scaled FP8 (weight-only; default: --dtype)",
    )
    _add_timing_flags(p)
    p.add_argument(
        "--check-rows",
        type=cli_arguments.positive_int,
        default=2048,
        help="tokens checked vs float32",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kernel-time",
        action="store_true",
        help="log each row's GPU time per kernel (a profiler trace of --iters more calls)",
    )
    p.add_argument(
        "--xla-defaults",
        action="store_true",
        help="compile the timed functions with XLA's default options, not a model step's",
    )
    p.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    p.add_argument(
        "--no-copy-ceiling", action="store_true", help="skip the copy yardstick (no 'of copy')"
    )
    p.add_argument(
        "--no-kernel-rows",
        dest="kernel_rows",
        action="store_false",
        help="skip the IMPL (kernel) rows and their compiles (each layer row is still checked)",
    )
    args = p.parse_args(argv)
    try:
        args.shapes = resolve_shapes(options.from_namespace(ShapeOptions, args), args.small)
    except ValueError as error:
        p.error(str(error))
    if args.small:
        args.tokens = "16,64" if args.tokens == p.get_default("tokens") else args.tokens
        args.warmup, args.iters, args.reps = 1, 2, 2
    return args


def main(argv: list[str]) -> None:
    """Prints one row per (T, impl) as measured, then the markdown table.

    Raises:
      SystemExit: bad flags, or an impl failed (its rows say why).
    """
    args = _parse(argv)
    shapes = args.shapes
    impls = [i for i in args.impls.split(",") if i]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    versions = f"jax {jax.__version__}"
    if any(i.startswith("tokamax") for i in impls):
        with contextlib.suppress(ImportError):  # the tokamax rows report the ImportError
            versions += f", tokamax {import_tokamax().__version__}"
    header = (
        f"date {datetime.date.today()}  device {jax.devices()[0].device_kind}  {versions}  "
        f"{'' if args.preset is None else f'preset {args.preset}: '}"
        f"H={shapes.hidden} F={shapes.ffn} E={shapes.experts} top-{shapes.top_k} {args.dtype}"
        f"{f', experts {args.expert_dtype}' if args.expert_dtype else ''}  "
        f"capacity factor {args.capacity_factor:g}  skew {args.skew:g}  "
        f"median of {args.reps} x {args.iters} calls"
    )
    if args.layers_per_call > 1:
        header += f"  {args.layers_per_call} layers a call (times per layer)"
    copy_gbs = None
    if not args.no_copy_ceiling:
        nbytes = GIB if not args.small else 1 << 20
        copy_gbs, label = device_rates.copy_gbs(nbytes, iters=args.iters * 4, reps=args.reps)
        header += f"  copy {copy_gbs:.0f} GB/s ({label})"
    _log(header)
    rows = [row for t in tokens for row in measure(t, impls, shapes, args)]
    cap_seconds = {r.tokens: r.seconds for r in rows if r.impl == "capacity" and r.seconds}
    dense_seconds = {r.tokens: r.seconds for r in rows if r.impl == "dense" and r.seconds}
    print()
    print(header)
    print("\n".join(TABLE_HEAD))
    for row in rows:
        print(format_row(row, cap_seconds.get(row.tokens), dense_seconds.get(row.tokens), copy_gbs))
    failed = [f"{r.impl} at T={r.tokens}: {r.error}" for r in rows if r.error is not None]
    if failed:
        raise SystemExit("grouped_gemm: impls failed:\n" + "\n".join(failed))
