"""The kernels a ``ModelRunner`` uses when the caller names none.

``moe_runner_backend=None`` and ``attention_backend=None`` take the fastest impl measured on the
platform jax runs on (``jtbo.kernels.impls.FASTEST``, whose comments name the benchmark logs in
docs/benchmarks/) among those that can serve the model's shapes: the Pallas grouped GEMM and the
paged attention kernel on GPUs where their Triton tiles fit (matmul dimensions in multiples of 16;
the widths the kernel loads whole, such as value heads, powers of two >= 16, and the widths it loads
in power-of-two parts, such as MLA's keys, multiples of 16), the XLA paths (the capacity einsum and
the native attention, the exact references) otherwise and on the CPU. A name given explicitly is
used as is; one that cannot serve the model fails where its kernel is built.
"""

from collections.abc import Sequence

from jtbo.kernels import gemm_config, impls, launch_checks

# The attention backends by the impl name impls.FASTEST ranks them under.
_ATTENTION_BACKEND_OF_IMPL = {"xla": "native", "pallas": "pallas", "triton": "triton"}
_TRITON_KEY_PARTS = 2  # the Triton attention kernels load a key in at most two parts


def _power_of_two_tile(dim: int) -> bool:
    return dim >= gemm_config.MIN_DOT_BLOCK and launch_checks.is_power_of_two(dim)


def moe_runner_backend(name: str | None, matmul_dims: Sequence[int] = ()) -> str:
    """``name``, or ``"auto"`` where the routed experts' fastest FFN impl here is a kernel
    that tiles ``matmul_dims``, else ``"xla"``.

    ``"auto"`` leaves the choice to each compiled step: the Pallas kernels at decode sizes,
    the Mosaic GPU ones from ``grouped_gemm.MOSAIC_MIN_ROWS`` rows on Hopper GPUs
    (``grouped_gemm.auto_impl``).

    Args:
      name: a ``layer_ops.MOE_RUNNER_BACKENDS`` name (kept as given) or None.
      matmul_dims: the expert FFN's hidden size and per-device intermediate size.

    Returns:
      "auto" or "xla", or ``name``.
    """
    if name is not None:
        return name
    impl = impls.resolve(None, op="grouped_ffn")
    return "auto" if impl != "xla" and all(map(gemm_config.dot_tiles, matmul_dims)) else "xla"


def attention_backend(
    name: str | None,
    attention_kind: str = "gqa",
    whole_widths: Sequence[int] = (),
    split_widths: Sequence[int] = (),
    key_parts: int = 1,
) -> str:
    """``name``, or the fastest attention backend here that serves the model.

    Args:
      name: a backend name (kept as given) or None.
      attention_kind: the model's ``MoEConfig.attention_kind``: "gqa" ranks the paged
        kernel, "mla" the paged kernel over the latent pool (``paged.LATENT_OP``).
      whole_widths: widths the kernel loads in one block (GQA's head width; MLA's
        ``kv_lora_rank`` and ``v_head_dim``, its two value widths).
      split_widths: widths the kernel loads in power-of-two parts (MLA's RoPE key part of
        the latent row, and its decompressed key ``qk_nope_head_dim + qk_rope_head_dim``).
      key_parts: the most power-of-two column parts a key row is loaded in (MLA's latent row
        of 512 + 64: 2); the Triton kernels take at most two.

    Returns:
      "native", "pallas" or "triton".
    """
    if name is not None:
        return name
    op = "mla_latent_attention" if attention_kind == "mla" else "paged_attention"
    backend = _ATTENTION_BACKEND_OF_IMPL[impls.resolve(None, op=op)]
    fits = all(map(_power_of_two_tile, whole_widths)) and all(
        map(gemm_config.dot_tiles, split_widths)
    )
    if backend == "triton":
        fits = fits and key_parts <= _TRITON_KEY_PARTS
    return backend if backend == "native" or fits else "native"
