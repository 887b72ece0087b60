"""The XLA compile options that keep two micro-batches apart, in one place.

Two-batch overlap relies on the two micro-batches staying independent dataflow until XLA's
latency-hiding scheduler has placed one's asynchronous collectives over the other's compute.
Passes that merge independent work fuse them back together (docs/benchmarks/, "Overlap
coverage (8xH200 compile on the CPU) of the toy MoE stack"):

- the dot merger joins A's and B's matmuls that share a weight into one matmul;
- the all-gather / reduce-scatter combiners join A's and B's collectives into one, which
  then has nothing independent left to overlap and turns synchronous. The all-reduce
  combiner does the same to ``psum`` (SUM_LEN DP gathers), and the collective-permute
  combiner to ring exchanges.

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
"""Environment a multi-GPU TBO process with XLA's EP exchanges ("dense", "ragged") should start
with (read when CUDA starts: set it before JAX first touches a GPU).

``CUDA_DEVICE_MAX_CONNECTIONS=1``: one hardware work queue per device. On two H200s it let
an NCCL exchange and the compute beside it share the GPU far better, in the overlap probe and
in the TBO model step; copy engines for local peers and fewer NCCL channels, tried on the same
probe, did not (docs/benchmarks/, "Run-time overlap on two H200s").

The peer-copy exchange wants the opposite: with one queue its side stream's copies queue
behind the compute stream's kernels and run one after the other (docs/benchmarks/, "Peer-copy
EP exchange on two H200s"), so there ``CUDA_DEVICE_MAX_CONNECTIONS`` must not be 1.
"""


def process_env_advice(environ: Mapping[str, str], ep_exchange: str = "dense") -> list[str]:
    """What a process environment lacks for run-time overlap, one sentence per variable.

    Args:
      environ: the environment to check (``os.environ``).
      ep_exchange: the runner's EP exchange: "peer_copy" needs ``CUDA_DEVICE_MAX_CONNECTIONS``
        other than 1; XLA's exchanges want ``TBO_PROCESS_ENV``.

    Returns:
      An empty list when every variable has its recommended value.
    """
    if ep_exchange == "peer_copy":
        if environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
            return []
        return [
            "CUDA_DEVICE_MAX_CONNECTIONS=1 serializes the peer-copy exchange's side stream "
            "behind the compute stream: unset it before JAX starts for run-time overlap "
            "(jtbo.overlap.xla_options.TBO_PROCESS_ENV)"
        ]
    return [
        f"{name}={environ.get(name, '<unset>')}: set {name}={value} before JAX starts for "
        "run-time overlap on multi-GPU TBO steps (jtbo.overlap.xla_options.TBO_PROCESS_ENV)"
        for name, value in TBO_PROCESS_ENV
        if environ.get(name) != value
    ]
