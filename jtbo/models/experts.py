"""Routed experts as a grouped GEMM.

Default: the *capacity-slot* layout. Every (token, choice) pair gets a slot
``(expert, position)``, where ``position`` counts earlier pairs routed to the same expert; the
``[E, capacity, H]`` slots name their token rows (``kernels.SlotRows``), one batched matmul
runs all experts (the XLA impl materializes the slots; the Pallas kernel loads the rows
through the index), and each token sums its slots' outputs times its routing weights. This
is the layout the dense all-to-all dispatch produces, and on the H200 it ran at dense-matmul
speed, far faster than ``jax.lax.ragged_dot`` (docs/benchmarks/, "Grouped GEMM for the routed
experts").
``capacity = num_tokens`` can never drop a pair, since a token picks an expert at most once.

The slot FFN takes each expert's row count and an ``impl`` (``jtbo.kernels.grouped_gemm``):
``"xla"`` runs the batched matmul over every slot; ``"pallas"`` runs a grouped GEMM kernel over
the filled slots only (padding slots cost neither loads nor matmuls; they are never read
back, so the kernel leaves them unwritten); ``"mosaic"`` runs the Hopper twin of that kernel,
whose outputs stay in its own tile-major rows and are read back through their slot index
(``slot_rows.take_slots``); ``"auto"`` picks between the two by the call's rows.

FP8 experts (``MoEConfig.expert_dtype``): ``RoutedExperts`` holds each weight as FP8 values
and float32 block scales, stored contraction-last (``fp8_blocks.expert_axes``: ``w_gate_up``
as ``[E, 2, F, H]``, ``w_down`` as ``[E, H, F]``, each expert's matrices ``[out, in]`` as a
checkpoint has them, which is how the FP8 kernel reads its weight tiles), and hands them on as
``fp8_blocks.BlockQuantized`` with those ``axes``, whose ``shape`` is the weight's own ``[E, H,
2, F]`` / ``[E, F, H]``. The slot FFN takes them as they are (``jtbo.kernels.grouped_gemm``),
with FP8 rows (``MoEConfig.expert_fp8_activations``: each token's channels quantized per
block, DeepSeek-V3's scheme) or float ones (weight-only); the sorted layout and the references
dequantize them, which gives the weight's own order (``float_weights``), and put the rows
through the same FP8 rounding (``activation_groups``).

Reference: ``experts_ragged_dot_reference`` sorts pairs by expert and runs ``jax.lax.ragged_dot``
(exact, no capacity).

Gate and up are one fused weight ``w_gate_up [E, H, 2, F]``, as in ``jtbo.models.mlp``: one
matmul reads it. (A one-device TBO step runs both micro-batches' experts as one call,
``jtbo.models.moe_exchange``. Before that, XLA's dot merger joined A's and B's einsums. With
two weights it joined the gate and the up matmuls separately, so both concatenations copied
the same rows: docs/benchmarks/, "TBO step cost on one H200", decode-sized children and
unsigned EP indices.)
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jtbo.collectives import rows as rows_lib
from jtbo.kernels import fp8_blocks, gemm_config, grouped_gemm, slot_rows
from jtbo.models import config as config_lib
from jtbo.models import mlp


def slot_positions(topk_ids: jax.Array, num_experts: int) -> jax.Array:
    """Position of each (token, choice) pair within its expert, in token-major order.

    Args:
      topk_ids: ``[T, k]`` expert per pair; a value outside ``[0, E)`` (e.g. -1 for padding)
        takes no slot.
      num_experts: E.

    Returns:
      ``[T, k]`` int32 positions (undefined for pairs that take no slot).
    """
    position, _ = rows_lib.group_ranks(topk_ids.reshape(-1), num_experts)
    return position.reshape(topk_ids.shape)


def experts_ffn_slots(
    x_slots: jax.Array | slot_rows.SlotRows,
    counts: jax.Array,
    weights: tuple[grouped_gemm.Weight, grouped_gemm.Weight],
    *,
    impl: str = "xla",
    max_rows: int | None = None,
    config: gemm_config.GroupedFfnConfig | gemm_config.MosaicFfnConfig | None = None,
    zero_padding: bool = True,
    fp8_activations: bool = True,
) -> jax.Array | slot_rows.SlotRows:
    """SwiGLU of every expert over its first ``counts[e]`` slots (``kernels.grouped_gemm``).

    Args:
      x_slots: ``[E, C, H]`` rows per expert slot, or ``SlotRows`` naming each slot's row
        (an EP dispatch's; the Pallas kernel loads through the index).
      counts: ``[E]`` int32 rows per expert (its first slots; clipped to ``[0, C]``).
      weights: ``(w_gate_up [E, H, 2, F] (gate at index 0, up at 1), w_down [E, F, H])``,
        arrays in ``x_slots``' dtype or both FP8 (``fp8_blocks.BlockQuantized``).
      impl: ``"xla"`` (batched einsum over all ``C`` slots), ``"pallas"`` (the exact-count
        grouped GEMM kernels), ``"mosaic"`` (their Hopper twins) or ``"auto"`` (by the rows),
        as ``MoEOptions.moe_runner_backend`` names it.
      max_rows: static bound on the total rows (see ``kernels.grouped_gemm``); None: ``E * C``.
      config: the kernels' launch shapes; None for the default.
      zero_padding: False when the caller never reads the slots past ``counts``: the Pallas
        kernel then leaves them undefined instead of zeroing them.
      fp8_activations: FP8 weights: whether the rows are quantized too
        (``MoEConfig.expert_fp8_activations``; ``kernels.grouped_gemm``).

    Returns:
      ``[E, C, H]`` in ``x_slots.dtype``, zero in slots past ``counts`` (undefined with
      ``zero_padding=False`` on the Pallas impl; partial sums when F is a shard); with
      ``"mosaic"``, ``SlotRows`` standing for it (``grouped_gemm.grouped_ffn_rows``), which
      ``slot_rows.take_flat`` / ``take_slots`` read.

    Raises:
      ValueError: shapes that do not fit, an unknown impl.
      KernelUnavailableError: the impl cannot run here.
    """
    return grouped_gemm.grouped_ffn_rows(
        x_slots, counts, *weights, impl=impl, config=config, max_rows=max_rows,
        zero_padding=zero_padding, fp8_activations=fp8_activations,
    )  # fmt: skip


def experts_capacity(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    weights: tuple[grouped_gemm.Weight, grouped_gemm.Weight],
    capacity: int | None = None,
    *,
    impl: str = "xla",
    config: gemm_config.GroupedFfnConfig | gemm_config.MosaicFfnConfig | None = None,
    fp8_activations: bool = True,
) -> jax.Array:
    """Routed-expert output per token through the capacity-slot layout.

    Args:
      x: ``[T, H]`` tokens.
      topk_ids: ``[T, k]`` chosen experts (out-of-range ids take no slot and add nothing).
      topk_weights: ``[T, k]`` routing weights.
      weights: ``(w_gate_up [E, H, 2, F], w_down [E, F, H])``, arrays or FP8
        (``fp8_blocks.BlockQuantized``).
      capacity: slots per expert; None means ``T`` (never drops).
      impl: the slot FFN's impl (``grouped_gemm.grouped_ffn_rows``): "xla", "pallas",
        "mosaic" or "auto".
      config: the kernels' launch shapes (a ``GroupedFfnConfig`` for "pallas", a
        ``MosaicFfnConfig`` for "mosaic"); None for the default.
      fp8_activations: FP8 weights: whether the rows are quantized too (``experts_ffn_slots``).

    Returns:
      ``[T, H]`` in ``x.dtype``; pairs beyond ``capacity`` are dropped.
    """
    num_experts = weights[0].shape[0]
    capacity = x.shape[0] if capacity is None else capacity
    position, loads = rows_lib.group_ranks(topk_ids.reshape(-1), num_experts)
    position = position.reshape(topk_ids.shape)
    valid = (topk_ids >= 0) & (topk_ids < num_experts) & (position < capacity)
    expert = jnp.where(valid, topk_ids, num_experts)  # out of bounds: takes no slot
    slots = slot_rows.SlotRows(x, _slot_tokens(expert, position, num_experts, capacity))
    counts = jnp.minimum(loads, capacity)  # an expert's first `capacity` pairs fill its slots
    max_rows = min(num_experts * capacity, topk_ids.size)  # a pair fills at most one slot
    # The gather below reads only filled slots: the kernel need not zero the rest.
    out_slots = experts_ffn_slots(
        slots, counts.astype(jnp.int32), weights, impl=impl, max_rows=max_rows,
        config=config, zero_padding=False, fp8_activations=fp8_activations,
    )  # fmt: skip
    gathered = slot_rows.take_slots(out_slots, expert, position)  # [T, k, H]
    scale = jnp.where(valid, topk_weights, 0.0).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", gathered.astype(jnp.float32), scale).astype(x.dtype)


def _slot_tokens(expert, position, num_experts: int, capacity: int) -> jax.Array:
    """``[E, C]`` the token row in each slot (-1 empty) of the pairs ``(expert, position)``
    (``[T, k]``; expert ``E`` for a pair that takes no slot)."""
    num_slots = num_experts * capacity
    # A pair that takes no slot targets num_slots, which the scatter drops.
    slot = jnp.where(expert < num_experts, expert * capacity + position, num_slots).reshape(-1)
    token = jnp.arange(slot.shape[0], dtype=jnp.int32) // expert.shape[1]
    # The token itself is scattered (not the pair, divided after): one pass over the slots.
    empty = jnp.full((num_slots,), -1, jnp.int32)
    return empty.at[slot].set(token, mode="drop").reshape(num_experts, capacity)


def experts_sorted(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    weights: tuple[grouped_gemm.Weight, grouped_gemm.Weight],
    grouped_dot,
    *,
    hidden_dtype=jnp.float32,
    out_dtype=jnp.float32,
    activation_groups: tuple[int, int] | None = None,
) -> jax.Array:
    """Routed-expert output with the (token, choice) pairs sorted by expert and a grouped GEMM.

    Args:
      x: ``[T, H]`` tokens.
      topk_ids: ``[T, k]`` chosen experts (every id in ``[0, E)``).
      topk_weights: ``[T, k]`` routing weights.
      weights: ``(w_gate_up [E, H, 2, F], w_down [E, F, H])``; FP8 ones
        (``fp8_blocks.BlockQuantized``) are dequantized to ``x.dtype`` first.
      grouped_dot: ``grouped_dot(lhs [M, K], rhs [E, K, N], group_sizes [E], out_dtype)
        -> [M, N]``, rows of group ``e`` times ``rhs[e]`` (``jax.lax.ragged_dot``, or a
        Pallas grouped GEMM such as tokamax's).
      hidden_dtype: ``out_dtype`` asked of the gate / up GEMMs.
      out_dtype: ``out_dtype`` asked of the down GEMM.
      activation_groups: FP8 activations (``RoutedExperts.activation_groups``): the rows and
        the hidden rows go through FP8 per that many columns
        (``fp8_blocks.fake_quantize_rows``); None: they stay as they are.

    Returns:
      ``[T, H]`` in ``x.dtype`` (nothing is dropped).
    """
    w_gate_up, w_down = float_weights(weights, x.dtype)
    rows_through_fp8 = activation_rounding(activation_groups, x.dtype)
    num_experts, hidden_size, _, ffn = w_gate_up.shape
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    rows = rows_through_fp8(x, 0)[order // top_k]
    sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    f32 = jnp.float32
    rhs = w_gate_up.reshape(num_experts, hidden_size, 2 * ffn)  # gate columns, then up
    gate_up = grouped_dot(rows, rhs, sizes, hidden_dtype).astype(f32).reshape(-1, 2, ffn)
    hidden = rows_through_fp8(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], 1).astype(x.dtype)
    out = grouped_dot(hidden, w_down, sizes, out_dtype).astype(f32)
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkh,tk->th", unsorted, topk_weights.astype(f32)).astype(x.dtype)


def activation_rounding(activation_groups: tuple[int, int] | None, dtype):
    """``(rows, which) -> rows``: the rows (``which`` 0) or hidden rows (1) through FP8 per
    ``activation_groups[which]`` columns (``fp8_blocks.fake_quantize_rows``) and back in
    ``dtype``, as FP8 activations see them; the rows as they are for None.

    Args:
      activation_groups: ``RoutedExperts.activation_groups``.
      dtype: the dtype the rounded rows come back in.

    Returns:
      The rounding function.
    """
    if activation_groups is None:
        return lambda rows, which: rows
    return lambda rows, which: fp8_blocks.fake_quantize_rows(rows, activation_groups[which]).astype(
        dtype
    )


def _lax_ragged_dot(lhs, rhs, group_sizes, out_dtype):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def experts_ragged_dot_reference(
    x: jax.Array,
    topk_ids: jax.Array,
    topk_weights: jax.Array,
    weights: tuple[grouped_gemm.Weight, grouped_gemm.Weight],
    activation_groups: tuple[int, int] | None = None,
) -> jax.Array:
    """Exact routed-expert output: ``experts_sorted`` over ``jax.lax.ragged_dot`` in float32.

    Args and Returns: as ``experts_capacity`` (no capacity: nothing is dropped);
    ``activation_groups`` as ``experts_sorted``'s.
    """
    return experts_sorted(
        x, topk_ids, topk_weights, weights, _lax_ragged_dot, activation_groups=activation_groups
    )


class StoredDtypeParam(nnx.Param):
    """A parameter kept in its own dtype: ``jtbo.models.cast`` leaves it as it is (FP8 expert
    values and their float32 block scales)."""


class RoutedExperts(nnx.Module):
    """Stacked expert weights ``gate_up [E, H, 2, F]``, ``down [E, F, H]``.

    With ``MoEConfig.expert_dtype="float8_e4m3fn"`` each is block-scaled FP8
    (``jtbo.kernels.fp8_blocks``): ``w_gate_up`` / ``w_down`` hold the FP8 values and
    ``w_gate_up_scale`` / ``w_down_scale`` their float32 scales, one per
    ``expert_block_size`` block of each expert's matrices (both ``StoredDtypeParam``). FP8
    parameters are stored contraction-last (``fp8_blocks.expert_axes``): values ``[E, 2, F,
    H]`` and ``[E, H, F]``, scales in the same order; ``weights`` gives them as
    ``BlockQuantized`` with those ``axes``.
    """

    def __init__(self, config: config_lib.MoEConfig, *, rngs: nnx.Rngs):
        """Args: config: model config; rngs: parameter init keys."""
        e, h, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
        w_gate_up = mlp.init_matrix(rngs, (e, h, 2, f), h)  # [E, H, 2, F]
        w_down = mlp.init_matrix(rngs, (e, f, h), f)  # [E, F, H]
        self.block = None if config.expert_dtype is None else config.expert_block_size
        self.fp8_activations = self.block is not None and config.expert_fp8_activations
        if self.block is None:
            self.w_gate_up, self.w_down = w_gate_up, w_down
            return
        gate_up, down = (
            fp8_blocks.quantize_experts(w[...], self.block) for w in (w_gate_up, w_down)
        )
        # Stored contraction-last (fp8_blocks.expert_axes); bk, bn = expert_block_size.
        self.w_gate_up = StoredDtypeParam(gate_up.values)  # [E, 2, F, H] float8_e4m3fn
        self.w_gate_up_scale = StoredDtypeParam(gate_up.scales)  # [E, 2, ceil(F/bn), ceil(H/bk)]
        self.w_down = StoredDtypeParam(down.values)  # [E, H, F] float8_e4m3fn
        self.w_down_scale = StoredDtypeParam(down.scales)  # [E, ceil(H/bn), ceil(F/bk)] float32

    @property
    def weights(self) -> tuple[grouped_gemm.Weight, grouped_gemm.Weight]:
        """``(w_gate_up, w_down)`` as arrays, or as ``fp8_blocks.BlockQuantized`` for FP8
        experts, their ``axes`` the stored order (local shards inside a shard_map)."""
        if self.block is None:
            return self.w_gate_up[...], self.w_down[...]
        return (
            _blocked(self.w_gate_up[...], self.w_gate_up_scale[...], self.block),
            _blocked(self.w_down[...], self.w_down_scale[...], self.block),
        )

    @property
    def activation_groups(self) -> tuple[int, int] | None:
        """``(row group, hidden group)``: the columns per FP8 scale of the rows and of the
        hidden rows when the experts quantize them (``fp8_activations``), else None."""
        return (self.block[0], self.block[0]) if self.fp8_activations else None


def _blocked(values: jax.Array, scales: jax.Array, block: tuple[int, int]):
    """The ``BlockQuantized`` of an FP8 expert weight's stored parameters."""
    ndim = values.ndim
    return fp8_blocks.BlockQuantized(
        values, scales, fp8_blocks.expert_block_shape(ndim, block), fp8_blocks.expert_axes(ndim)
    )


def float_weights(
    weights: tuple[grouped_gemm.Weight, grouped_gemm.Weight], dtype
) -> tuple[jax.Array, jax.Array]:
    """The expert weights as float arrays: FP8 ones dequantized to ``dtype`` (float32 math),
    float ones as they are.

    Args:
      weights: ``(w_gate_up, w_down)``, arrays or ``fp8_blocks.BlockQuantized``.
      dtype: the dtype of dequantized weights.

    Returns:
      ``(w_gate_up [E, H, 2, F], w_down [E, F, H])``, whatever order FP8 ones are stored in
      (``dequantize_blocks`` gives the weight's own).
    """
    return tuple(
        fp8_blocks.dequantize_blocks(w, dtype) if isinstance(w, fp8_blocks.BlockQuantized) else w
        for w in weights
    )


def check_expert_shards(config: config_lib.MoEConfig, moe_a2a_backend: str, devices: int) -> None:
    """Checks that FP8 experts' blocks do not straddle a device's shard.

    ``"ep"`` shards whole experts (always aligned); ``"none"`` splits every expert's hidden
    width ``F`` over the devices, so each device's columns of ``w_gate_up`` and rows of
    ``w_down`` must be whole blocks.

    Args:
      config: the model config.
      moe_a2a_backend: "ep" or "none".
      devices: devices the experts are sharded over.

    Raises:
      ValueError: ``F / devices`` not a multiple of both block sizes (names the sizes).
    """
    if config.expert_dtype is None or moe_a2a_backend != "none":
        return
    width = config.moe_intermediate_size
    block = config.expert_block_size
    if width % devices or (width // devices) % math.lcm(*block):
        raise ValueError(
            f"moe_a2a_backend='none' splits moe_intermediate_size={width} over {devices} "
            f"devices; FP8 experts need each share to be whole expert_block_size={block} "
            "blocks: use moe_a2a_backend='ep' or float experts"
        )
