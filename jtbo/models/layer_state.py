"""The state a decoder layer's operations share, and the context each micro-batch gives them.

``LayerState`` declares every entry the operations of ``jtbo.models.layer_ops`` and
``jtbo.models.moe_exchange`` set and pop, so a misspelt entry raises where it is used
(``jtbo.overlap.operation_state`` says why the state is a mutable object with declared
entries rather than a frozen pytree). ``MicroBatchContext`` holds the read-only entries of one
micro-batch (or of the whole batch without TBO).
"""

import dataclasses
from typing import Any

import jax

from jtbo.overlap import operation_state


@dataclasses.dataclass(frozen=True)
class MicroBatchContext:
    """One micro-batch's read-only state entries (the whole batch's without TBO).

    Attributes:
      attn_metadata: its attention metadata.
      dp_context: its DP context (``jtbo.collectives.context``).
      num_tokens: its real token rows (a traced int32 scalar).
      micro_batch: 0 for A or the whole batch, 1 for B (its index in the step box's counts).
      ep_dispatcher: its EP dispatcher; None without EP.
      step_box: the ``layer_ops.StepBox`` both micro-batches share (KV cache, EP counts).
    """

    attn_metadata: Any
    dp_context: Any
    num_tokens: Any  # [] int32
    micro_batch: int
    ep_dispatcher: Any | None
    step_box: Any


class LayerState(operation_state.OperationState):
    """A layer's entries, each from the operation that sets it to the one that pops it.

    ``rows`` are the micro-batch's token rows, ``hidden`` the model width.
    """

    positions: jax.Array  # [rows] int32; comm_prepare_attn .. comm_postprocess_layer
    residual_after_input_ln: jax.Array  # [rows, hidden]; comm_prepare_attn .. comm_prepare_mlp
    hidden_states_after_comm_pre_attn: jax.Array  # [rows, hidden]; the normed attention input
    attn_qkv: Any  # the attention's projected queries, keys and values (``attn.qkv``)
    hidden_states_after_attn: jax.Array  # attention output before the output projection
    residual_after_comm_pre_mlp: jax.Array  # [rows, hidden]; the residual after attention
    hidden_states_mlp_input: jax.Array  # [rows, hidden]; the normed MLP / MoE input
    hidden_states_mlp_output: jax.Array  # [rows, hidden]; the MLP / MoE output
    router_logits: jax.Array  # [rows, experts]
    topk_weights_local: jax.Array  # [rows, top_k] routing weights
    topk_ids_local: jax.Array  # [rows, top_k] expert ids, -1 for padding rows
    shared_output: jax.Array  # [rows, hidden] the shared experts' output
    dispatch_in_flight: Any  # InFlight: the dispatch exchange issued by dispatch_a
    dispatch_output: Any  # what dispatch_b received, as the experts read it
    expert_output: Any  # the experts' output, as combine_a sends it
    combine_in_flight: Any  # InFlight: the combine exchange issued by combine_a
    hidden_states_after_combine: jax.Array  # [rows, hidden] the routed experts' output
