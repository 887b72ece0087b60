"""The kernels a ``ModelRunner`` uses when the caller names none.

``moe_runner_backend=None`` and ``attention_backend=None`` take the fastest impl measured on
the platform jax runs on (``jtbo.kernels.impls.FASTEST``, from the H200 benchmarks in
BENCHMARKS.md): the Pallas grouped GEMM and the paged attention kernel on GPUs, the XLA paths
(the capacity einsum and the native attention, the exact references) on the CPU. A name given
explicitly is used as is; one that cannot run here fails where its kernel is built.
"""

from jtbo.kernels import impls

# The attention backends by the impl name impls.FASTEST ranks them under.
_ATTENTION_BACKEND_OF_IMPL = {"xla": "native", "pallas": "pallas"}


def moe_runner_backend(name: str | None) -> str:
    """``name``, or the routed experts' fastest FFN impl here ("xla" or "pallas")."""
    return name if name is not None else impls.resolve(None, op="grouped_ffn")


def attention_backend(name: str | None, attention_kind: str = "gqa") -> str:
    """``name``, or the fastest attention backend here for ``attention_kind``.

    Args:
      name: a backend name (kept as given) or None.
      attention_kind: the model's ``MoEConfig.attention_kind``; MLA has only the native
        backend.

    Returns:
      "native" or "pallas".
    """
    if name is not None:
        return name
    if attention_kind == "mla":
        return "native"
    return _ATTENTION_BACKEND_OF_IMPL[impls.resolve(None, op="paged_attention")]
