"""Scatter modes of the (hidden_states, residual) stream and the conversions between them.

How a layer's token rows are spread over the ("dp", "attn_tp") mesh (SGLang ``ScatterMode``),
for ``dp = 2``, ``attn_tp = 2`` serving sequences a, b (DP rank 0) and c, d (DP rank 1):

* SCATTERED   ``[a, b, c, d]``: each device holds ``1 / attn_tp`` of its DP rank's rows
  (``local_capacity / attn_tp`` rows).
* TP_ATTN_FULL ``[ab, ab, cd, cd]``: each device holds all of its DP rank's rows
  (``local_capacity`` rows) - the mode of attention and of the model's input/output.
* FULL        ``[abcd] x 4``: each device holds every DP rank's rows (``global_buffer_len``
  rows) - the mode of a TP-sharded MLP/MoE.

Two modes whose groups have the same size (SCATTERED and TP_ATTN_FULL when ``attn_tp == 1``;
TP_ATTN_FULL and FULL when ``dp == 1`` and the buffers have equal rows) hold the same data and
convert trivially. The three conversions mirror SGLang's layer communicator:

* ``communicate_simple`` (before attention): SCATTERED -> TP_ATTN_FULL by an all-gather in
  ``attn_tp``.
* ``communicate_with_all_reduce_and_layernorm`` (after attention, before the MLP): attention's
  TP_ATTN_FULL output is a partial sum over ``attn_tp``; complete it, add it into the residual
  and normalise. To FULL: attn_tp rank 0 adds the residual into its partial, a
  ``dp_gather_partial`` sums and gathers, the residual becomes this rank's rows of that sum
  (``dp_scatter``) and the MLP input is its norm. To SCATTERED: a reduce-scatter in
  ``attn_tp``, the residual sliced the same way.
* ``communicate_summable_tensor_pair`` (after the MLP): FULL -> TP_ATTN_FULL by ``dp_scatter``
  (or ``dp_reduce_scatter_tensor`` when the MLP left partial sums); SCATTERED -> TP_ATTN_FULL
  folds the residual into the hidden states and all-gathers them; TP_ATTN_FULL -> SCATTERED
  slices.

Everything works on local shards inside ``jax.shard_map`` over the mesh.
"""

import enum
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jtbo.collectives import context as context_lib
from jtbo.collectives import gather, rows, scatter
from jtbo.collectives import mesh as mesh_lib


class ScatterMode(enum.Enum):
    """How token rows are spread over the mesh: SCATTERED, TP_ATTN_FULL or FULL."""

    SCATTERED = enum.auto()
    TP_ATTN_FULL = enum.auto()
    FULL = enum.auto()

    @staticmethod
    def model_input_output() -> "ScatterMode":
        """The mode of the model's input and output: TP_ATTN_FULL."""
        return ScatterMode.TP_ATTN_FULL


def group_size(mode: ScatterMode, context: context_lib.DpContext) -> int:
    """Devices that share one copy of the rows in ``mode`` (SGLang's process-group size)."""
    return {
        ScatterMode.SCATTERED: 1,
        ScatterMode.TP_ATTN_FULL: context.attn_tp_size,
        ScatterMode.FULL: context.dp_size * context.attn_tp_size,
    }[mode]


def num_rows(mode: ScatterMode, context: context_lib.DpContext) -> int:
    """Rows each device holds in ``mode``."""
    return {
        ScatterMode.SCATTERED: context.local_capacity // context.attn_tp_size,
        ScatterMode.TP_ATTN_FULL: context.local_capacity,
        ScatterMode.FULL: context.global_buffer_len,
    }[mode]


def is_same_layout(a: ScatterMode, b: ScatterMode, context: context_lib.DpContext) -> bool:
    """Whether the two modes hold identical buffers (equal group size and row count)."""
    return group_size(a, context) == group_size(b, context) and num_rows(a, context) == num_rows(
        b, context
    )


def communicate_simple(
    hidden_states: jax.Array,
    context: context_lib.DpContext,
    *,
    input_mode: ScatterMode,
    output_mode: ScatterMode,
) -> jax.Array:
    """Moves attention's input between modes (SGLang ``CommunicateSimpleFn``).

    Args:
      hidden_states: rows in ``input_mode``.
      context: the step's DP context.
      input_mode: the rows' mode now.
      output_mode: the mode wanted.

    Returns:
      The rows in ``output_mode``.

    Raises:
      ValueError: the conversion is not one SGLang defines (only SCATTERED -> TP_ATTN_FULL).
    """
    _check_rows(hidden_states, input_mode, context, "hidden_states")
    if is_same_layout(input_mode, output_mode, context):
        return hidden_states
    if (input_mode, output_mode) == (ScatterMode.SCATTERED, ScatterMode.TP_ATTN_FULL):
        return _all_gather_attn_tp(hidden_states)
    raise ValueError(f"communicate_simple cannot convert {input_mode.name} -> {output_mode.name}")


def communicate_with_all_reduce_and_layernorm(
    hidden_states: jax.Array,
    residual: jax.Array,
    context: context_lib.DpContext,
    *,
    hidden_states_input_mode: ScatterMode,
    residual_input_mode: ScatterMode,
    hidden_states_output_mode: ScatterMode,
    residual_output_mode: ScatterMode,
    norm: Callable[[jax.Array], jax.Array],
    memcpy_impl: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Completes attention's partial output, adds it into the residual, normalises.

    Args:
      hidden_states: attention output, partial sums over ``attn_tp`` (TP_ATTN_FULL).
      residual: the residual stream in ``residual_input_mode``.
      context: the step's DP context.
      hidden_states_input_mode: TP_ATTN_FULL (or any mode equal to the output's layout when
        ``attn_tp == 1``).
      residual_input_mode: SCATTERED or TP_ATTN_FULL.
      hidden_states_output_mode: FULL (a TP MLP follows) or SCATTERED (an EP MoE follows).
      residual_output_mode: TP_ATTN_FULL with a FULL output, SCATTERED with a SCATTERED one.
      norm: the post-attention norm, applied row-wise.
      memcpy_impl: ``impl`` of ``jtbo.kernels.dp_memcpy`` for the DP gather/scatter.

    Returns:
      ``(mlp_input, residual)``: ``norm(attention + residual)`` and ``attention + residual``
      in the output modes.

    Raises:
      ValueError: a mode combination SGLang does not define, or rows not matching the modes.
    """
    _check_rows(hidden_states, hidden_states_input_mode, context, "hidden_states")
    _check_rows(residual, residual_input_mode, context, "residual")
    if (
        is_same_layout(hidden_states_input_mode, hidden_states_output_mode, context)
        and is_same_layout(residual_input_mode, residual_output_mode, context)
        and context.attn_tp_size == 1
    ):
        residual = hidden_states + residual
        return norm(residual), residual
    from_attn = hidden_states_input_mode is ScatterMode.TP_ATTN_FULL and residual_input_mode in (
        ScatterMode.SCATTERED,
        ScatterMode.TP_ATTN_FULL,
    )
    modes_out = (hidden_states_output_mode, residual_output_mode)
    if from_attn and modes_out == (ScatterMode.FULL, ScatterMode.TP_ATTN_FULL):
        return _gather_hidden_states_and_residual(
            hidden_states, residual, context, residual_input_mode, norm, memcpy_impl
        )
    if from_attn and modes_out == (ScatterMode.SCATTERED, ScatterMode.SCATTERED):
        return _scatter_hidden_states_and_residual(
            hidden_states, residual, context, residual_input_mode, norm
        )
    raise ValueError(
        "communicate_with_all_reduce_and_layernorm cannot convert hidden_states "
        f"{hidden_states_input_mode.name} -> {hidden_states_output_mode.name} with residual "
        f"{residual_input_mode.name} -> {residual_output_mode.name}"
    )


def communicate_summable_tensor_pair(
    hidden_states: jax.Array,
    residual: jax.Array | None,
    context: context_lib.DpContext,
    *,
    hidden_states_input_mode: ScatterMode,
    residual_input_mode: ScatterMode,
    output_mode: ScatterMode,
    hidden_states_is_partial_sum: bool = False,
    memcpy_impl: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Brings the MLP output and the residual to the layer's output mode.

    The pair is summable: the result may be ``(hidden_states + residual, None)``.

    Args:
      hidden_states: the MLP output in ``hidden_states_input_mode``.
      residual: the residual in ``residual_input_mode`` (or None).
      context: the step's DP context.
      hidden_states_input_mode: FULL, SCATTERED or TP_ATTN_FULL.
      residual_input_mode: the residual's mode.
      output_mode: the layer output's mode.
      hidden_states_is_partial_sum: FULL input only: the MLP left partial sums over the TP
        group, so reduce-scatter them (``dp_reduce_scatter_tensor``) instead of copying.
      memcpy_impl: ``impl`` of ``jtbo.kernels.dp_memcpy``.

    Returns:
      ``(hidden_states, residual)`` in ``output_mode`` (residual None once folded in).

    Raises:
      ValueError: a mode combination SGLang does not define, or rows not matching the modes.
    """
    _check_rows(hidden_states, hidden_states_input_mode, context, "hidden_states")
    if residual is not None:
        _check_rows(residual, residual_input_mode, context, "residual")
    if hidden_states_is_partial_sum and hidden_states_input_mode is not ScatterMode.FULL:
        raise ValueError(
            f"hidden_states_is_partial_sum needs FULL input, got {hidden_states_input_mode.name}"
        )
    if not hidden_states_is_partial_sum and (
        is_same_layout(hidden_states_input_mode, output_mode, context)
        and is_same_layout(residual_input_mode, output_mode, context)
    ):
        return hidden_states, residual
    modes = (hidden_states_input_mode, residual_input_mode, output_mode)
    if modes == (ScatterMode.FULL, ScatterMode.TP_ATTN_FULL, ScatterMode.TP_ATTN_FULL):
        to_local = (
            scatter.dp_reduce_scatter_tensor if hidden_states_is_partial_sum else scatter.dp_scatter
        )
        return to_local(hidden_states, context, memcpy_impl=memcpy_impl), residual
    if modes == (ScatterMode.SCATTERED, ScatterMode.SCATTERED, ScatterMode.TP_ATTN_FULL):
        if residual is not None:
            hidden_states = hidden_states + residual
        return _all_gather_attn_tp(hidden_states), None
    if modes == (ScatterMode.TP_ATTN_FULL, ScatterMode.TP_ATTN_FULL, ScatterMode.SCATTERED):
        rank = jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS)
        shard = rows.attn_tp_shard(hidden_states, context.attn_tp_size, rank)
        if residual is not None:
            residual = rows.attn_tp_shard(residual, context.attn_tp_size, rank)
        return shard, residual
    raise ValueError(
        f"communicate_summable_tensor_pair cannot convert hidden_states "
        f"{hidden_states_input_mode.name} / residual {residual_input_mode.name} -> "
        f"{output_mode.name}"
    )


def _gather_hidden_states_and_residual(
    hidden_states, residual, context, residual_input_mode, norm, memcpy_impl
):
    if residual_input_mode is ScatterMode.SCATTERED and context.attn_tp_size > 1:
        residual = _all_gather_attn_tp(residual)
    if context.dp_size == 1 and context.global_buffer_len == context.local_capacity:
        # One DP rank: FULL is TP_ATTN_FULL, completing the partial is an all-reduce. Rows
        # past the count are zeroed as the gather path zeroes them.
        residual = jax.lax.psum(hidden_states, mesh_lib.ATTN_TP_AXIS) + residual
        _, local_num_tokens = context_lib.get_dp_local_info(context)
        residual = rows.zero_rows_from(residual, local_num_tokens)
        return norm(residual), residual
    # The residual joins the partial sum once, on attn_tp rank 0, so the gather adds it in.
    is_first = jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS) == 0
    hidden_states = jnp.where(is_first, hidden_states + residual, hidden_states)
    gathered = gather.dp_gather_partial(hidden_states, context, memcpy_impl=memcpy_impl)
    residual = scatter.dp_scatter(gathered, context, memcpy_impl=memcpy_impl)
    return norm(gathered), residual


def _scatter_hidden_states_and_residual(hidden_states, residual, context, residual_mode, norm):
    hidden_states = jax.lax.psum_scatter(
        hidden_states, mesh_lib.ATTN_TP_AXIS, scatter_dimension=0, tiled=True
    )
    if residual_mode is ScatterMode.TP_ATTN_FULL:
        rank = jax.lax.axis_index(mesh_lib.ATTN_TP_AXIS)
        residual = rows.attn_tp_shard(residual, context.attn_tp_size, rank)
    residual = hidden_states + residual
    return norm(residual), residual


def _all_gather_attn_tp(x):
    return jax.lax.all_gather(x, mesh_lib.ATTN_TP_AXIS, axis=0, tiled=True)


def _check_rows(x, mode, context, name):
    expected = num_rows(mode, context)
    if x.shape[0] != expected:
        raise ValueError(f"{name} has {x.shape[0]} rows, {mode.name} holds {expected}")
