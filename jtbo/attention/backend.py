"""Attention backends: host metadata construction + the jittable forward.

SGLang's backends keep per-step metadata as mutable state; under ``jit`` the metadata must be
an input, so ``init_forward_metadata`` *returns* it (a numpy pytree to pass into the jitted
step) and ``forward`` takes it as an argument. The backend object itself holds only static
configuration (capacity, kernel knobs, score scale) and may be closed over by jitted code.

Three backends share the metadata and differ in the forward (``ATTENTION_BACKENDS``):
``"native"`` (``NativeAttnBackend``: blocked jnp attention, the exact reference and the CPU
path), ``"pallas"`` (``PallasAttnBackend``: the extend kernel of ``jtbo.attention.extend``
for EXTEND / MIXED capacities and the paged kernel of ``jtbo.attention.paged``, which reads
K/V through the page table, for decode and verify; the Pallas interpreter on the CPU) and
``"triton"`` (``TritonAttnBackend``: the same two kernels written in Triton and run through
jax-triton; GPUs only).
"""

from collections.abc import Callable

import jax

from jtbo.attention import batch_metadata, extend, mla, native, paged
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.attention import metadata as metadata_lib
from jtbo.split import batch as batch_lib


class NativeAttnBackend:
    """Paged attention in pure jnp for one DP rank at one static capacity.

    Attributes:
      capacity: the static sizes of the metadata this backend builds and consumes.
      config: native kernel knobs.
      scaling: score scale, or None for ``head_dim ** -0.5``.
    """

    def __init__(
        self,
        capacity: metadata_lib.AttentionCapacity,
        config: native.NativeAttentionConfig = native.DEFAULT_CONFIG,
        scaling: float | None = None,
    ):
        """Creates the backend.

        Args:
          capacity: static sizes (one compile per distinct value).
          config: native kernel knobs.
          scaling: score scale; None means ``head_dim ** -0.5``.
        """
        self.capacity = capacity
        self.config = config
        self.scaling = scaling

    def init_forward_metadata(
        self, batch: batch_lib.ForwardBatch
    ) -> metadata_lib.AttentionMetadata:
        """Builds the step's metadata from a host batch (eager path).

        Args:
          batch: one DP rank's host ``ForwardBatch`` (or a TBO child of it).

        Returns:
          Numpy-backed ``AttentionMetadata`` at ``self.capacity``.

        Raises:
          ValueError: the batch does not fit the capacity or lacks a field its mode needs.
        """
        return batch_metadata.forward_batch_metadata(batch, self.capacity)

    def _check_capacity(self, metadata: metadata_lib.AttentionMetadata) -> None:
        """Raises ValueError when ``metadata`` was built for another capacity than this one."""
        if metadata.capacity != self.capacity:
            raise ValueError(f"metadata capacity {metadata.capacity} != backend {self.capacity}")

    def empty_metadata(self) -> metadata_lib.AttentionMetadata:
        """Returns metadata that attends nothing (IDLE ranks, empty TBO children)."""
        return metadata_lib.empty_metadata(self.capacity)

    def forward(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        layer_id: int | jax.Array,
        metadata: metadata_lib.AttentionMetadata,
        kv_cache: kv_cache_lib.KVCache,
    ) -> tuple[jax.Array, kv_cache_lib.KVCache]:
        """Writes the new K/V at ``out_cache_loc`` and attends (jittable).

        Args:
          q: ``[token_capacity, q_heads, head_dim]``.
          k: ``[token_capacity, kv_heads, head_dim]``.
          v: ``[token_capacity, kv_heads, v_head_dim]``.
          layer_id: layer index.
          metadata: from ``init_forward_metadata`` (host or device arrays).
          kv_cache: the cache; donate it to update in place.

        Returns:
          ``(out [token_capacity, q_heads, v_head_dim], new kv_cache)``.

        Raises:
          ValueError: the metadata was built for another capacity, or shapes disagree.
        """
        self._check_capacity(metadata)
        return native.forward(
            q, k, v, layer_id, metadata, kv_cache, scaling=self.scaling, config=self.config
        )

    def forward_mla(
        self,
        q_nope: jax.Array,
        q_pe: jax.Array,
        latent: jax.Array,
        w_kv_b: jax.Array,
        layer_id: int | jax.Array,
        metadata: metadata_lib.AttentionMetadata,
        kv_cache: kv_cache_lib.KVCache,
        *,
        scaling: float,
    ) -> tuple[jax.Array, kv_cache_lib.KVCache]:
        """Writes the step's MLA latent rows and attends (``jtbo.attention.mla``; jittable).

        Extend metadata attends in the decompressed form, decode and verify metadata in the
        absorbed form (``mla.uses_absorbed``).

        Args:
          q_nope: ``[token_capacity, heads, qk_nope_head_dim]``.
          q_pe: ``[token_capacity, heads, qk_rope_head_dim]`` (RoPE applied).
          latent: ``[token_capacity, kv_lora_rank + qk_rope_head_dim]``.
          w_kv_b: ``[kv_lora_rank, heads, qk_nope_head_dim + v_head_dim]``.
          layer_id: layer index.
          metadata: from ``init_forward_metadata``.
          kv_cache: the latent cache; donate it to update in place.
          scaling: softmax scale.

        Returns:
          ``(out [token_capacity, heads, v_head_dim], new kv_cache)``.

        Raises:
          ValueError: the metadata was built for another capacity, or a non-latent cache.
          KernelUnavailableError: a kernel backend cannot read this latent width here.
        """
        self._check_capacity(metadata)
        return mla.forward(
            q_nope, q_pe, latent, w_kv_b, layer_id, metadata, kv_cache, scaling=scaling,
            absorbed=mla.uses_absorbed(self.capacity), **self._mla_impl(),
        )  # fmt: skip

    def _mla_impl(self) -> dict:
        """``mla.forward``'s kernel arguments: the native attention with this config."""
        return dict(config=self.config, impl="xla")


class PallasAttnBackend(NativeAttnBackend):
    """``NativeAttnBackend``'s metadata with Pallas kernels as the forward.

    Causal capacities of several queries per tile (EXTEND / MIXED) run the two-stage extend
    kernel (``jtbo.attention.extend``: the prefix through the page table, the step's tokens
    from its own K/V); decode (one query per tile) and verify (custom mask) capacities run the
    paged kernel (``jtbo.attention.paged``, split-K over long contexts).

    Attributes:
      capacity: the static sizes of the metadata this backend builds and consumes.
      config: the paged kernel's launch shape, or None for the pool's default
        (``paged.DEFAULT_CONFIG``; ``paged.LATENT_CONFIG`` over an MLA latent pool).
      extend_config: the extend kernel's launch shape.
      scaling: score scale, or None for ``head_dim ** -0.5``.
      impl: the kernels' impl (class attribute): ``"pallas"``.
    """

    impl = "pallas"

    def __init__(
        self,
        capacity: metadata_lib.AttentionCapacity,
        config: paged.PagedAttentionConfig | None = None,
        scaling: float | None = None,
        extend_config: extend.ExtendAttentionConfig = extend.DEFAULT_CONFIG,
    ):
        """Creates the backend.

        Args:
          capacity: static sizes (one compile per distinct value).
          config: the paged kernel's launch shape; None: ``paged.DEFAULT_CONFIG`` over K/V
            head pools and ``paged.LATENT_CONFIG`` over an MLA latent pool.
          scaling: score scale; None means ``head_dim ** -0.5``.
          extend_config: the extend kernel's launch shape.
        """
        super().__init__(capacity, scaling=scaling)
        self.config = config
        self.extend_config = extend_config

    def uses_extend_kernel(self) -> bool:
        """Whether this backend's capacity runs the extend kernel (else the paged one)."""
        return not self.capacity.custom_mask and self.capacity.query_tile > 1

    def forward(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        layer_id: int | jax.Array,
        metadata: metadata_lib.AttentionMetadata,
        kv_cache: kv_cache_lib.KVCache,
    ) -> tuple[jax.Array, kv_cache_lib.KVCache]:
        """Writes the new K/V at ``out_cache_loc`` and attends with the capacity's kernel.

        Args and returns as ``NativeAttnBackend.forward``.

        Raises:
          ValueError: the metadata was built for another capacity, or shapes disagree.
          KernelUnavailableError: the kernel cannot run these shapes on this platform.
        """
        self._check_capacity(metadata)
        if self.uses_extend_kernel():
            return extend.forward(
                q, k, v, layer_id, metadata, kv_cache, scaling=self.scaling, impl=self.impl,
                config=self.extend_config,
            )  # fmt: skip
        return paged.forward(
            q, k, v, layer_id, metadata, kv_cache, scaling=self.scaling, impl=self.impl,
            config=self.config or paged.DEFAULT_CONFIG,
        )  # fmt: skip

    def _mla_impl(self) -> dict:
        """Decode and verify metadata through the paged kernel over the latent pool (the
        absorbed form); extend metadata in the decompressed form through the kernel over the
        step's up-projected rows when no sequence has a prefix, else through the native
        attention at its defaults (the kernel has no decompressing form)."""
        return dict(impl=self.impl, kernel_config=self.config or paged.LATENT_CONFIG)


class TritonAttnBackend(PallasAttnBackend):
    """``PallasAttnBackend`` with the kernels' Triton twins (``impl="triton"``, jax-triton).

    The same algorithm, launch shapes and configs as the Pallas kernels, written in Triton's
    language (``jtbo.attention.triton_kernels``). GPUs with jax-triton only: elsewhere the
    forward raises ``KernelUnavailableError``.
    """

    impl = "triton"


ATTENTION_BACKENDS: dict[str, Callable[[metadata_lib.AttentionCapacity], NativeAttnBackend]] = {
    "native": NativeAttnBackend,
    "pallas": PallasAttnBackend,
    "triton": TritonAttnBackend,
}
"""Backend name (``ModelRunner(attention_backend=...)``) -> backend class."""


def backend_class(name: str) -> Callable[[metadata_lib.AttentionCapacity], NativeAttnBackend]:
    """Returns the backend class called ``name`` (a creator for ``TboAttnBackend.init_new``).

    Args:
      name: a key of ``ATTENTION_BACKENDS``.

    Returns:
      The class; ``cls(capacity)`` builds a backend with default knobs.

    Raises:
      ValueError: an unknown name.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r}: expected one of {tuple(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]
