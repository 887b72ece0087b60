"""Operation strategies: where a MoE layer yields to the other micro-batch (SGLang
``operations_strategy.py``).

A layer supplies its operations as a mapping from SGLang's operation names to callables;
a *layout* lists those names with yields between them, and the strategy for a model is the
concatenation of every layer's list. ``*_a`` operations issue a collective, ``*_b`` ones
consume it, so a yield between them leaves the collective in flight while the other
micro-batch computes. The names are SGLang's, for reading only: a layer marks an issuing
operation by handing it as ``operations.IssuingOperation``, which sets the operation's
``issues_collective`` field.

Layouts (``|`` = yield), per layer:

- DeepSeek prefill, ``d = 0``: ``comm_prepare_attn, attn_prepare, attn_core,
  comm_prepare_mlp, gate, select_experts, dispatch_a | dispatch_b, experts, combine_a |
  shared_experts, combine_b, output, comm_postprocess_layer``
- DeepSeek decode / target-verify, ``d = 2``: ``comm_prepare_attn, attn_prepare | attn_core,
  comm_prepare_mlp, gate, select_experts | dispatch_a, shared_experts | dispatch_b, experts,
  combine_a | combine_b | output, comm_postprocess_layer``
- Qwen3-style MoE (no shared experts): the DeepSeek prefill layout without
  ``shared_experts``; decode ``comm_prepare_attn, attn_prepare | attn_core, comm_prepare_mlp,
  gate, select_experts | dispatch_a | dispatch_b, experts, combine_a | combine_b, output,
  comm_postprocess_layer |``.

The layout is chosen from the *global* forward mode (the mode all DP ranks agreed on):
EXTEND (and MIXED, which has prefill's shape) takes the prefill layout; DECODE and
TARGET_VERIFY take the decode layout. SGLang raises for MIXED; here it runs the prefill
layout, since a mixed batch is dominated by its extend tokens.
"""

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jtbo.overlap import operations, row_joint
from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode
YIELD = "|"  # a yield in a layout


class LayerFamily(enum.Enum):
    """Which layer shape a layout is for."""

    DEEPSEEK = "deepseek"  # MoE with shared experts (DeepseekV2DecoderLayer)
    QWEN3_MOE = "qwen3_moe"  # MoE without shared experts (Qwen3MoeDecoderLayer)


_ATTN = ("comm_prepare_attn", "attn_prepare")
_ROUTE = ("attn_core", "comm_prepare_mlp", "gate", "select_experts")
_LAYOUTS: dict[tuple[LayerFamily, str], tuple[tuple[str, ...], int]] = {
    (LayerFamily.DEEPSEEK, "prefill"): (
        (*_ATTN, *_ROUTE, "dispatch_a", YIELD, "dispatch_b", "experts", "combine_a", YIELD)
        + ("shared_experts", "combine_b", "output", "comm_postprocess_layer"),
        0,
    ),
    (LayerFamily.DEEPSEEK, "decode"): (
        (*_ATTN, YIELD, *_ROUTE, YIELD, "dispatch_a", "shared_experts", YIELD, "dispatch_b")
        + ("experts", "combine_a", YIELD, "combine_b", YIELD, "output", "comm_postprocess_layer"),
        2,
    ),
    (LayerFamily.QWEN3_MOE, "prefill"): (
        (*_ATTN, *_ROUTE, "dispatch_a", YIELD, "dispatch_b", "experts", "combine_a", YIELD)
        + ("combine_b", "output", "comm_postprocess_layer"),
        0,
    ),
    (LayerFamily.QWEN3_MOE, "decode"): (
        (*_ATTN, YIELD, *_ROUTE, YIELD, "dispatch_a", YIELD, "dispatch_b", "experts")
        + ("combine_a", YIELD, "combine_b", "output", "comm_postprocess_layer", YIELD),
        2,
    ),
}


@dataclasses.dataclass(frozen=True)
class OperationsStrategy:
    """A model's operation list and how far micro-batch B trails A."""

    operations: tuple[operations.Operation, ...]  # all layers' operations, yields between stages
    tbo_delta_stages: int  # stages A runs alone before B starts (and B alone at the end)

    @classmethod
    def concat(cls, items: Sequence["OperationsStrategy"]) -> "OperationsStrategy":
        """Joins per-layer strategies into one.

        Raises:
          ValueError: no items, or the items disagree on ``tbo_delta_stages``.
        """
        if not items:
            raise ValueError("cannot concatenate zero strategies")
        deltas = {item.tbo_delta_stages for item in items}
        if len(deltas) != 1:
            raise ValueError(f"layers disagree on tbo_delta_stages: {sorted(deltas)}")
        ops = tuple(op for item in items for op in item.operations)
        return cls(operations=ops, tbo_delta_stages=deltas.pop())

    @classmethod
    def init_new_tbo(
        cls,
        layers: Sequence[Mapping[str, Callable[..., Any]]],
        forward_mode: ForwardMode,
        family: LayerFamily = LayerFamily.DEEPSEEK,
    ) -> "OperationsStrategy":
        """Builds the strategy of a stack of MoE layers for the global ``forward_mode``.

        Args:
          layers: per layer, a mapping from operation name to callable (exactly the names of
            the family's layout).
          forward_mode: the forward mode all DP ranks agreed on.
          family: the layers' shape (with or without shared experts).

        Returns:
          The concatenated strategy.

        Raises:
          ValueError: an unsupported forward mode, no layers, or a layer whose operation
            names differ from the layout's.
        """
        if not layers:
            raise ValueError("init_new_tbo needs at least one layer")
        layout, delta = layer_layout(family, forward_mode)
        return cls.concat(
            [
                cls(operations=layer_operations(index, ops, layout), tbo_delta_stages=delta)
                for index, ops in enumerate(layers)
            ]
        )


def layout_kind(forward_mode: ForwardMode) -> str:
    """Returns ``"prefill"`` or ``"decode"``: the layout a global forward mode takes.

    Raises:
      ValueError: a mode that cannot run two-batch overlap (IDLE, DRAFT_EXTEND, PREBUILT).
    """
    mode = ForwardMode(forward_mode)
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        return "prefill"
    if mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        return "decode"
    raise ValueError(
        f"forward_mode={mode.name} has no TBO operation strategy "
        "(EXTEND, MIXED, DECODE and TARGET_VERIFY do)"
    )


def layer_layout(family: LayerFamily, forward_mode: ForwardMode) -> tuple[tuple[str, ...], int]:
    """One layer's layout for a global forward mode, and micro-batch B's delay.

    Args:
      family: the layer's shape (with or without shared experts).
      forward_mode: the forward mode all DP ranks agreed on.

    Returns:
      ``(names, tbo_delta_stages)``: the operation names with ``YIELD`` markers between the
      stages (module docstring), and how many stages micro-batch A runs before B starts.

    Raises:
      ValueError: a mode that cannot run two-batch overlap (``layout_kind``).
    """
    return _LAYOUTS[(family, layout_kind(forward_mode))]


def layer_operations(
    layer_index: int, ops: Mapping[str, Callable[..., Any]], layout: tuple[str, ...]
) -> tuple[operations.Operation, ...]:
    """Arranges one layer's named callables in ``layout`` order, yields included.

    Raises:
      ValueError: the layer's names are not exactly the layout's.
    """
    wanted = {name for name in layout if name != YIELD}
    missing, extra = sorted(wanted - set(ops)), sorted(set(ops) - wanted)
    if missing or extra:
        raise ValueError(
            f"layer {layer_index}: operations missing {missing}, not in the layout {extra}"
        )
    return tuple(
        operations.YieldOperation()
        if name == YIELD
        else _execution_operation(f"L{layer_index}.{name}", ops[name])
        for name in layout
    )


def _execution_operation(debug_name: str, op) -> operations.ExecutionOperation:
    """A layer's callable, ``JointOperation`` (keeping its joint form),
    ``row_joint.RowWiseOperation`` (keeping the mark) or ``operations.IssuingOperation``
    (``issues_collective``), as an operation."""
    if isinstance(op, operations.JointOperation):
        return operations.ExecutionOperation(debug_name, op.fn, op.joint_fn)
    if isinstance(op, operations.IssuingOperation):
        return operations.ExecutionOperation(debug_name, op.fn, issues_collective=True)
    if isinstance(op, row_joint.RowWiseOperation):
        return operations.ExecutionOperation(debug_name, op.fn, row_wise=True)
    return operations.ExecutionOperation(debug_name=debug_name, fn=op)
