"""One micro-batch's whole step as one operation list: embedding, every layer, logits.

The TBO executor staggers two micro-batches by ``d`` stages (``d = 2`` for decode): A runs
its first ``d`` stages alone and B its last ``d`` stages alone. A collective issued in such a
stage has no other-micro-batch work to hide under, and so has any collective that runs before
the split or after the merge. In the AOT overlap report, when only the MoE layers were
overlapped: the dense layer's attention all-reduce ran before the split (belonging to neither
micro-batch), A's first attention all-reduce over ``attn_tp`` (decode) ran in A's lone stages
and so did B's last ``attn_tp`` all-gather of the combined experts output (decode), all
uncovered. So the step runs *everything* per micro-batch, SGLang's layer layouts unchanged for
the MoE layers, with work that needs no communication placed where the other micro-batch's
collectives need cover:

* prologue: the embedding and the dense layers before the first MoE layer, each cut as
  ``comm_prepare_attn, attn_prepare | attn_core | comm_prepare_mlp, mlp,
  comm_postprocess_layer |`` (the embedding joins the first stage). A's lone stages are then
  compute only, and A's first all-reduce runs beside B's QKV projection. (SGLang runs the
  dense layers before the split; running them per micro-batch costs nothing numerically,
  since every operation is row-wise or per-sequence attention.)
* MoE layers: ``jtbo.overlap.strategy`` layouts of the global forward mode; a dense layer
  after the first MoE layer (Qwen-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``) keeps
  the prologue's dense layout in place.
* epilogue: final norm and LM head, one stage (``final_norm, logits``), or two
  (``final_norm | logits``) for layouts whose last stage still communicates (Qwen3-style
  decode ends with ``combine_b``), so B's last collective runs beside A's LM head. A step
  that returns only the sampled rows (``step.step_body`` with ``logit_rows``) ends with the
  final norm and runs the LM head once, after both micro-batches, on those few rows.

The same list runs without TBO (one batch, yields ignored), so both paths execute the same
operations per row.
"""

import jax.numpy as jnp

from jtbo.models import config as config_lib
from jtbo.models import layer_ops, norm
from jtbo.models import model as model_lib
from jtbo.overlap import operations, strategy

YIELD = strategy.YIELD
DENSE_LAYOUT = (
    ("comm_prepare_attn", "attn_prepare", YIELD, "attn_core", YIELD)
    + ("comm_prepare_mlp", "mlp", "comm_postprocess_layer", YIELD)
)  # fmt: skip
_TWO_STAGE_EPILOGUE = {(strategy.LayerFamily.QWEN3_MOE, "decode")}


def layer_family(config: config_lib.MoEConfig) -> strategy.LayerFamily:
    """DeepSeek layout with shared experts, Qwen3-MoE layout without."""
    if config.num_shared_experts:
        return strategy.LayerFamily.DEEPSEEK
    return strategy.LayerFamily.QWEN3_MOE


def _leading_dense(model: model_lib.MoEModel) -> int:
    """How many layers come before the first MoE layer."""
    kinds = [layer.is_moe for layer in model.layers]
    return kinds.index(True) if True in kinds else len(kinds)


def _dense_operations(layer, parallel) -> tuple[operations.Operation, ...]:
    named = layer_ops.dense_layer_operations(layer, parallel)
    return strategy.layer_operations(layer.layer_id, named, DENSE_LAYOUT)


def prologue_operations(
    model: model_lib.MoEModel, parallel: layer_ops.ParallelConfig
) -> list[operations.Operation]:
    """Embedding and the leading dense layers in ``DENSE_LAYOUT`` stages (embedding alone
    without them).

    Args:
      model: the model (local shards).
      parallel: the mesh layout.

    Returns:
      Operations taking ``input_ids``, ``positions`` and ending the dense layers with a yield.
    """

    def embed(state, input_ids, positions):
        hidden = model.embed(input_ids)
        return dict(hidden_states=hidden, residual=jnp.zeros_like(hidden), positions=positions)

    ops: list[operations.Operation] = [operations.ExecutionOperation("embed", embed, row_wise=True)]
    dense = model.layers[: _leading_dense(model)]
    if not dense:
        return ops + [operations.YieldOperation()]
    for layer in dense:
        ops += _dense_operations(layer, parallel)
    return ops


def moe_operations(
    model: model_lib.MoEModel, parallel: layer_ops.ParallelConfig, mode
) -> strategy.OperationsStrategy | None:
    """The layers from the first MoE layer on (None: no MoE layer).

    Each run of consecutive MoE layers takes the strategy layout of the global ``mode``; a
    dense layer between or after them (``decoder_sparse_step``, ``mlp_only_layers``) takes
    ``DENSE_LAYOUT``, which ends with a yield, so the stage structure stays a list of whole
    stages.
    """
    rest = model.layers[_leading_dense(model) :]
    if not rest:
        return None
    family = layer_family(model.config)
    ops: list[operations.Operation] = []
    delta, run = 0, []
    for layer in [*rest, None]:
        if layer is not None and layer.is_moe:
            run.append(layer_ops.moe_layer_operations(layer, model.config, parallel))
            continue
        if run:
            built = strategy.OperationsStrategy.init_new_tbo(run, mode, family)
            ops += built.operations
            delta, run = built.tbo_delta_stages, []
        if layer is not None:
            ops += _dense_operations(layer, parallel)
    return strategy.OperationsStrategy(tuple(ops), delta)


def epilogue_operations(model: model_lib.MoEModel, two_stages: bool, lm_head: bool = True) -> list:
    """Final norm and LM head: ``logits`` ``[rows, vocab]`` float32 out.

    Without ``lm_head`` the epilogue is the final norm alone (``hidden_states`` out): the
    step then runs the LM head once, on the rows a sampler reads (``step.step_body``).
    """

    def final_norm(state, hidden_states, residual, positions):
        del positions
        weight, eps = model.final_norm.weight[...], model.config.rms_norm_eps
        return dict(hidden_states=norm.rms_norm(hidden_states + residual, weight, eps))

    def logits(state, hidden_states):
        return dict(logits=model.logits(hidden_states))

    norm_op = operations.ExecutionOperation("final_norm", final_norm, row_wise=True)
    if not lm_head:
        return [norm_op]
    middle = [operations.YieldOperation()] if two_stages else []
    return [norm_op, *middle, operations.ExecutionOperation("logits", logits, row_wise=True)]


def step_operations(
    model: model_lib.MoEModel, parallel: layer_ops.ParallelConfig, mode, *, lm_head: bool = True
) -> tuple[list[operations.Operation], int]:
    """The whole step of one micro-batch and the stage delta of the global mode.

    Args:
      model: the model (local shards).
      parallel: the mesh layout.
      mode: the global forward mode (picks the MoE layout).
      lm_head: end with the LM head over every row; False ends with the final norm.

    Returns:
      ``(operations, tbo_delta_stages)``: inputs ``input_ids``, ``positions``; output
      ``logits`` (``hidden_states`` without ``lm_head``).
    """
    ops = prologue_operations(model, parallel)
    moe = moe_operations(model, parallel, mode)
    delta = 0 if moe is None else moe.tbo_delta_stages
    if moe is not None:
        ops += list(moe.operations)
    if not isinstance(ops[-1], operations.YieldOperation):
        ops.append(operations.YieldOperation())
    kind = strategy.layout_kind(mode)
    two_stages = (layer_family(model.config), kind) in _TWO_STAGE_EPILOGUE
    return ops + epilogue_operations(model, two_stages, lm_head), delta
