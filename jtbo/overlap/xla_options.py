"""The XLA compile options that keep two micro-batches apart, in one place.

Two-batch overlap relies on the two micro-batches staying independent dataflow until XLA's
latency-hiding scheduler has placed one's asynchronous collectives over the other's compute.
Passes that merge independent work fuse them back together (measured on 8xH200 compiles of
toy MoE stacks, DESIGN.md "Facts"):

- the dot merger joins A's and B's matmuls that share a weight into one matmul (coverage
  0.25; 1.0 with ``xla_gpu_dot_merger_threshold_mb=0``);
- the all-gather / reduce-scatter combiners join A's and B's collectives into one, which
  then has nothing independent left to overlap and turns synchronous (coverage 0.02; 0.98
  with both combine thresholds at 0). The all-reduce combiner does the same to ``psum``
  (SUM_LEN DP gathers), and the collective-permute combiner to ring exchanges.

The names are XLA ``DebugOptions`` fields, accepted by ``compile(compiler_options=...)``; an
unknown name is rejected by the compiler ("No such compile option"), and the tests compile
with these to keep the names checked. There is no all-to-all combiner option in XLA (the
name ``xla_gpu_all_to_all_combine_threshold_bytes`` is rejected); none was needed, the
all-to-alls stayed apart.
"""

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class TboXlaOptions:
    """Compile options for a two-batch-overlap step."""

    dot_merger_threshold_mb: int = 0  # 0: never merge matmuls (A's and B's share weights)
    all_gather_combine_threshold_bytes: int = 0  # 0: never combine all-gathers
    reduce_scatter_combine_threshold_bytes: int = 0  # 0: never combine reduce-scatters
    all_reduce_combine_threshold_bytes: int = 0  # 0: never combine all-reduces
    collective_permute_combine_threshold_bytes: int = 0  # 0: never combine permutes
    parallel_collective_overlap_limit: int | None = None  # None: XLA's default (1)
    extra: tuple[tuple[str, str | int | bool | float], ...] = ()  # more (name, value) pairs

    def compiler_options(self) -> dict[str, str | int | bool | float]:
        """Returns the options as ``compiler_options`` for ``jit(...).lower(...).compile``."""
        options: dict[str, str | int | bool | float] = {
            "xla_gpu_dot_merger_threshold_mb": self.dot_merger_threshold_mb,
            "xla_gpu_all_gather_combine_threshold_bytes": self.all_gather_combine_threshold_bytes,
            "xla_gpu_reduce_scatter_combine_threshold_bytes": (
                self.reduce_scatter_combine_threshold_bytes
            ),
            "xla_gpu_all_reduce_combine_threshold_bytes": self.all_reduce_combine_threshold_bytes,
            "xla_gpu_collective_permute_combine_threshold_bytes": (
                self.collective_permute_combine_threshold_bytes
            ),
        }
        if self.parallel_collective_overlap_limit is not None:
            options["xla_gpu_experimental_parallel_collective_overlap_limit"] = (
                self.parallel_collective_overlap_limit
            )
        options.update(dict(self.extra))
        return options


TBO_XLA_OPTIONS = TboXlaOptions()  # the options TBO steps are compiled with


def tbo_compiler_options(
    options: TboXlaOptions = TBO_XLA_OPTIONS,
    overrides: Mapping[str, str | int | bool | float] | None = None,
) -> dict[str, str | int | bool | float]:
    """Returns the compile options of a TBO step, with ``overrides`` applied last.

    Args:
      options: the base options.
      overrides: option name -> value, e.g. from ``--xla-option KEY=VALUE``.

    Returns:
      A dict for ``jax.jit(..., compiler_options=...)`` or ``.compile(compiler_options=...)``.
    """
    merged = options.compiler_options()
    merged.update(overrides or {})
    return merged


def parse_option(text: str) -> tuple[str, str | int | bool | float]:
    """Parses ``KEY=VALUE`` into a compile option (ints, floats and true/false recognised).

    Raises:
      ValueError: no ``=`` or an empty key.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"xla option must be KEY=VALUE, got {text!r}")
    return key.strip(), _parse_value(raw.strip())


def _parse_value(raw: str) -> str | int | bool | float:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            continue
    return raw


TBO_PROCESS_ENV = (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)
"""Environment a multi-GPU TBO process should start with (read when CUDA starts: set it
before JAX first touches a GPU).

``CUDA_DEVICE_MAX_CONNECTIONS=1``: one hardware work queue per device. Measured on two H200s
(jax 0.11.2, BENCHMARKS.md "Run-time overlap on two H200s"): with each 448 MiB all-to-all
pinned beside a block of matmuls (``python -m jtbo.bench overlap``), the share of the shorter
chain hidden rose from 0.21-0.33 to 0.57-0.69; in the TBO model step the share of NCCL time
under compute rose from 0.60-0.79 to 0.81-0.88. Tried on the same probe and not kept: copy
engines for local peers (``xla_gpu_use_memcpy_local_p2p``: 0.30, 0.14 with one connection),
``NCCL_MAX_NCHANNELS=4`` (0.32, the exchange 3.7x slower).
"""


def process_env_advice(environ: Mapping[str, str]) -> list[str]:
    """What a process environment lacks of ``TBO_PROCESS_ENV``, one sentence per variable.

    Args:
      environ: the environment to check (``os.environ``).

    Returns:
      An empty list when every variable has its recommended value.
    """
    return [
        f"{name}={environ.get(name, '<unset>')}: set {name}={value} before JAX starts for "
        "run-time overlap on multi-GPU TBO steps (jtbo.overlap.xla_options.TBO_PROCESS_ENV)"
        for name, value in TBO_PROCESS_ENV
        if environ.get(name) != value
    ]
