"""Which implementation serves a call.

``"xla"`` is plain jnp and runs everywhere. ``"pallas"`` runs the Pallas kernel
through the Triton lowering on GPUs and through the Pallas interpreter on the CPU.
``"triton"`` runs a hand-written Triton kernel through jax-triton, on GPUs only;
jax-triton is imported on first use, since it does not import on a CPU-only
jaxlib. An impl asked for by name either serves the call or raises
``KernelUnavailableError``; ``impl=None`` takes the first available impl in the
op's and backend's order of measured speed (``FASTEST``). ``"mosaic"`` (Pallas Mosaic GPU:
TMA loads and ``wgmma``) serves the ops of ``MOSAIC_OPS`` only, on Hopper GPUs (compute
capability 9.x), and through Mosaic GPU's interpreter on the CPU.
"""

import functools
import importlib

import jax

IMPLS = ("xla", "pallas", "triton")
"""The impls every op has."""
MOSAIC = "mosaic"
MOSAIC_OPS = ("grouped_ffn",)
"""The ops that also have ``MOSAIC``."""

# Fastest first, per op and backend (measured: docs/benchmarks/, "Kernels: the copy
# kernels"). dp_memcpy's kernel beats XLA's row scatter; XLA fuses slice_pad and merge_rows
# into neighbouring work, which no standalone kernel can, so xla stays their default and the
# kernels serve explicit requests. On the CPU the Pallas interpreter is for testing only.
_GPU_KERNEL_FIRST = ("pallas", "triton", "xla")
_GPU_XLA_FIRST = ("xla", "pallas", "triton")
FASTEST = {
    "dp_memcpy": {"gpu": _GPU_KERNEL_FIRST, "cpu": ("xla",)},
    "slice_pad": {"gpu": _GPU_XLA_FIRST, "cpu": ("xla",)},
    "merge_rows": {"gpu": _GPU_XLA_FIRST, "cpu": ("xla",)},
    # The grouped GEMM skips empty capacity slots: faster from prefill sizes on, even at
    # decode sizes (docs/benchmarks/, "The Pallas grouped GEMM (exact counts)"). grouped_ffn's
    # impl=None also takes MOSAIC from grouped_gemm.MOSAIC_MIN_ROWS rows on Hopper GPUs
    # (grouped_gemm.auto_impl; docs/benchmarks/, "the grouped FFN on Mosaic GPU").
    "grouped_ffn": {"gpu": ("pallas", "xla"), "cpu": ("xla",)},
    # jtbo.kernels.tile_gather: the kernel skips dead tiles, XLA's gather writes them (the
    # Mosaic grouped GEMM's input; docs/benchmarks/, "The gather into row tiles").
    "gather_tiles": {"gpu": ("pallas", "xla"), "cpu": ("xla",)},
    # The paged attention op: "xla" is the native attention, which the paged kernel beats in
    # decode and extend (docs/benchmarks/, "Attention: the paged kernel"); its Triton twin is
    # slower at decode (docs/benchmarks/, "Attention: the jax-triton kernels").
    "paged_attention": {"gpu": ("pallas", "triton", "xla"), "cpu": ("xla",)},
    # The extend attention op: the two-stage extend kernel against the native attention
    # (docs/benchmarks/, "Attention: the extend kernel"); the Triton twin is slower.
    "extend_attention": {"gpu": ("pallas", "triton", "xla"), "cpu": ("xla",)},
    # paged_attention(value_width=...) (MLA's absorbed decode): the paged kernel over the
    # latent pool beats the native attention (docs/benchmarks/, "MLA on H200s").
    "mla_latent_attention": {"gpu": ("pallas", "triton", "xla"), "cpu": ("xla",)},
}


class KernelUnavailableError(RuntimeError):
    """An impl asked for by name cannot run here; the message names the impl and why."""


def backend() -> str:
    """The platform jax compiles for by default: ``"cpu"``, ``"gpu"``, ``"tpu"``, ..."""
    return jax.default_backend()


@functools.cache
def _import_jax_triton():
    return importlib.import_module("jax_triton")


def op_impls(op: str) -> tuple[str, ...]:
    """The impl names ``op`` takes."""
    return IMPLS + ((MOSAIC,) if op in MOSAIC_OPS else ())


def unavailable_reason(impl: str, platform: str) -> str | None:
    """Why ``impl`` cannot run on ``platform``, or None when it can."""
    if impl == "xla":
        return None
    if impl == MOSAIC:
        return _mosaic_unavailable_reason(platform)
    if impl == "pallas":
        return None if platform in ("cpu", "gpu") else f"no Pallas Triton lowering on {platform}"
    if platform != "gpu":
        return f"jax-triton runs on GPUs only; the backend is {platform}"
    try:
        _import_jax_triton()
    except ImportError as err:
        return f"jax-triton does not import ({err})"
    return None


def _mosaic_unavailable_reason(platform: str) -> str | None:
    if platform == "cpu":
        return None  # Mosaic GPU's interpreter
    if platform != "gpu":
        return f"Mosaic GPU runs on NVIDIA GPUs only; the backend is {platform}"
    capability = getattr(jax.devices()[0], "compute_capability", "")
    if not str(capability).startswith("9."):
        return (
            f"the Mosaic GPU kernels use Hopper's wgmma (compute capability 9.x), not {capability}"
        )
    return None


def resolve(impl: str | None, *, op: str, payload_bytes: int = 0, xla_below_bytes: int = 0) -> str:
    """Returns the impl that serves a call.

    Args:
      impl: one of ``op_impls(op)`` or None for the fastest available for ``op`` here.
      op: the op's name, a key of ``FASTEST``.
      payload_bytes: the largest number of bytes the call can copy (static).
      xla_below_bytes: with ``impl=None``, payloads up to this size take ``"xla"`` (0: no
        such rule, the op's ``FASTEST`` order decides).

    Returns:
      The impl name.

    Raises:
      ValueError: an unknown impl name.
      KernelUnavailableError: the named impl cannot run on this backend.
    """
    platform = backend()
    if impl is None and xla_below_bytes > 0 and payload_bytes <= xla_below_bytes:
        return "xla"
    if impl is None:
        order = FASTEST[op].get(platform, ("xla",))
        return next(name for name in order if unavailable_reason(name, platform) is None)
    if impl not in op_impls(op):
        raise ValueError(f"{op}: impl must be one of {op_impls(op)} or None, got {impl!r}")
    reason = unavailable_reason(impl, platform)
    if reason is not None:
        raise KernelUnavailableError(f"impl={impl!r} is unavailable: {reason}")
    return impl


def jax_triton():
    """The jax_triton module (imported on first use)."""
    return _import_jax_triton()


def check_pallas_elems(elem_counts, block_elems: int) -> None:
    """Raises KernelUnavailableError when a Pallas kernel's int32 element indices overflow.

    The Pallas kernels index elements in int32 (jax's default integer without x64);
    the largest index is a buffer's element count plus one block of slack.
    """
    largest = max(elem_counts) + block_elems
    if largest >= 2**31:
        raise KernelUnavailableError(
            f"impl='pallas' indexes elements in int32; a buffer of {largest - block_elems} "
            f"elements plus a block of {block_elems} reaches 2**31: use impl='triton' or 'xla'"
        )
