"""The model's layer loop with or without two-batch overlap (SGLang ``model_forward_maybe_tbo``).

Without TBO, the operations of every layer run once over the whole batch. With TBO:

1. hidden states and residual are brought to TP_ATTN_FULL (each attn_tp rank holds all of its
   DP rank's tokens) - the mode in which a token-range split is a plain row slice;
2. hidden states, residual and positions are cut at the traced split token index into two
   zero-padded children of static ``child_capacity`` rows (``jtbo.split.split_inputs``);
3. each child is brought to the layers' input mode (with the child's DP context);
4. the two children run through the same operations staggered
   (``operations.execute_overlapped_operations``), each with its own context (attention
   metadata, EP dispatcher, DP context, child ForwardBatch);
5. the children's outputs are written back at their parent offsets (``jtbo.split.merge_outputs``).

Within a micro-batch the operations and their order are the same either way, so the two paths
agree numerically up to the rounding of differently shaped matmuls. The operations see
inputs ``hidden_states``, ``residual``, ``positions`` and must return (at the end of every
layer) a mapping with the same three keys.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jtbo.collectives import context as context_lib
from jtbo.collectives import scatter_mode as scatter_mode_lib
from jtbo.overlap import operations, strategy
from jtbo.split import activations

ScatterMode = scatter_mode_lib.ScatterMode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TboSplit:
    """Where the step's tokens are cut into micro-batches A and B."""

    split_token_index: jax.Array  # [] int32; rows [0, t) are A's
    num_tokens: jax.Array  # [] int32; rows [t, n) are B's
    child_capacity: int = dataclasses.field(metadata=dict(static=True))  # rows per child buffer


@dataclasses.dataclass(frozen=True)
class ScatterModes:
    """Scatter modes around the split (all TP_ATTN_FULL: no conversion at all)."""

    input_data: ScatterMode = ScatterMode.TP_ATTN_FULL  # mode of the given hidden/residual
    layer_input: ScatterMode = ScatterMode.TP_ATTN_FULL  # mode the first layer expects
    dp_context: Any = None  # the parent's DpContext; needed when a conversion is not trivial
    child_dp_contexts: tuple[Any, Any] = (None, None)  # children's DpContexts, likewise


def model_forward_maybe_tbo(
    layers: Sequence[Mapping[str, Callable[..., Any]]],
    enable_tbo: bool,
    positions: jax.Array,
    forward_batch: Any,
    hidden_states: jax.Array,
    residual: jax.Array,
    *,
    tbo_split: TboSplit | None = None,
    context: Mapping[str, Any] | None = None,
    child_contexts: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None] = (None, None),
    family: strategy.LayerFamily = strategy.LayerFamily.DEEPSEEK,
    forward_mode: strategy.ForwardMode | None = None,
    scatter_modes: ScatterModes = ScatterModes(),
    barriers: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Runs the layers over the step's tokens, as two overlapped micro-batches when asked.

    Args:
      layers: per layer, operation name -> callable (``strategy.OperationsStrategy``).
      enable_tbo: run two overlapped micro-batches.
      positions: ``[num_tokens]`` token positions.
      forward_batch: the step's batch (opaque here; put into the plain path's context as
        ``forward_batch``); its ``global_forward_mode`` chooses the strategy unless
        ``forward_mode`` is given.
      hidden_states: ``[num_tokens, hidden]`` in ``scatter_modes.input_data``.
      residual: ``[num_tokens, hidden]``, same mode.
      tbo_split: the traced split (required with ``enable_tbo``).
      context: read-only state entries of the plain (non-TBO) path.
      child_contexts: read-only state entries of micro-batch A and B.
      family: the layers' shape (with or without shared experts).
      forward_mode: the global forward mode; by default ``forward_batch.global_forward_mode``.
      scatter_modes: conversions around the split.
      barriers: pin rounds with optimization barriers (in-flight results left out); on by
        default because it kept every collective covered on 8 x H200 compiles
        (``report.FINDINGS``).

    Returns:
      ``(hidden_states, residual)`` of the last layer, ``[num_tokens, hidden]``.

    Raises:
      ValueError: TBO without a ``tbo_split``, or no forward mode to choose a strategy by.
    """
    mode = _global_forward_mode(forward_batch, forward_mode)
    operations_strategy = strategy.OperationsStrategy.init_new_tbo(layers, mode, family)
    inputs = dict(hidden_states=hidden_states, residual=residual, positions=positions)
    if not enable_tbo:
        plain_context = dict(context or {})
        plain_context.setdefault("forward_batch", forward_batch)
        outputs = operations.execute_operations(
            inputs, operations_strategy.operations, context=plain_context
        )
        return outputs["hidden_states"], outputs["residual"]
    if tbo_split is None:
        raise ValueError("enable_tbo=True needs tbo_split (split index, token count, capacity)")
    inputs_arr = _split_inputs(inputs, tbo_split, scatter_modes)
    outputs_arr = operations.execute_overlapped_operations(
        inputs_arr,
        [operations_strategy.operations] * 2,
        [0, operations_strategy.tbo_delta_stages],
        contexts_arr=child_contexts,
        barriers=barriers,
    )
    return _merge_outputs(outputs_arr, tbo_split, out_len=hidden_states.shape[0])


def _global_forward_mode(forward_batch: Any, forward_mode):
    mode = (
        forward_mode
        if forward_mode is not None
        else getattr(forward_batch, "global_forward_mode", None)
    )
    if mode is None:
        raise ValueError(
            "no forward mode: pass forward_mode= or a forward_batch with global_forward_mode"
        )
    return mode


def _split_inputs(inputs: dict, tbo_split: TboSplit, modes: ScatterModes) -> list[dict]:
    hidden_states, residual = _convert_pair(
        inputs["hidden_states"],
        inputs["residual"],
        modes.input_data,
        ScatterMode.TP_ATTN_FULL,
        modes.dp_context,
    )
    children = activations.split_inputs(
        dict(hidden_states=hidden_states, residual=residual, positions=inputs["positions"]),
        tbo_split.split_token_index,
        tbo_split.num_tokens,
        child_capacity=tbo_split.child_capacity,
    )
    converted = []
    for child, dp_context in zip(children, modes.child_dp_contexts, strict=True):
        child_hidden, child_residual = _convert_pair(
            child["hidden_states"],
            child["residual"],
            ScatterMode.TP_ATTN_FULL,
            modes.layer_input,
            dp_context,
        )
        converted.append(dict(child, hidden_states=child_hidden, residual=child_residual))
    return converted


def _convert_pair(hidden_states, residual, input_mode, output_mode, dp_context):
    """SGLang ``CommunicateSummableTensorPairFn`` between two modes (identity when equal)."""
    if input_mode is output_mode:
        return hidden_states, residual
    if not isinstance(dp_context, context_lib.DpContext):
        raise ValueError(
            f"converting {input_mode.name} -> {output_mode.name} needs a DpContext, "
            f"got {type(dp_context).__name__}"
        )
    return scatter_mode_lib.communicate_summable_tensor_pair(
        hidden_states,
        residual,
        dp_context,
        hidden_states_input_mode=input_mode,
        residual_input_mode=input_mode,
        output_mode=output_mode,
    )


def _merge_outputs(outputs_arr, tbo_split: TboSplit, *, out_len: int):
    output_a, output_b = (
        dict(hidden_states=out["hidden_states"], residual=out["residual"]) for out in outputs_arr
    )
    merged = activations.merge_outputs(
        output_a, output_b, tbo_split.split_token_index, tbo_split.num_tokens, out_len=out_len
    )
    return merged["hidden_states"], merged["residual"]
