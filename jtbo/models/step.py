"""The sharded model step: one jitted ``jax.shard_map`` over the ``("dp", "attn_tp")`` mesh.

Body (local shards, per DP rank): embedding -> dense layers (one batch) -> MoE layers, either
as one batch (``execute_operations``) or, with two-batch overlap, split at the traced token
index into two zero-padded children, run staggered with the strategy of the global forward
mode and merged back (``jtbo.overlap.layer_loop.model_forward_maybe_tbo``, with round barriers)
-> final norm -> LM head. As in SGLang, the first ``first_k_dense`` layers
run before the split. The KV cache is threaded through micro-batch A's and then B's attention
of every layer (``layer_ops.StepBox``).

Per-rank inputs carry a leading ``dp`` axis (sharded over ``"dp"``, replicated over
``"attn_tp"``); DP contexts are replicated. Parameters are sharded by ``param_specs``:
attention heads over ``attn_tp``; routed experts over all devices by expert (``ep``) or by
their hidden width (``none``); everything else replicated. The step returns logits
``[dp, capacity, vocab]`` (float32), the updated KV cache and the number of routed pairs
dropped for lack of EP capacity (the host refuses a step with any).
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import layer_ops, norm
from jtbo.models import model as model_lib
from jtbo.overlap import layer_loop, operations, strategy, xla_options
from jtbo.split import forward_mode as forward_mode_lib

ATTN_TP = mesh_lib.ATTN_TP_AXIS
_HEAD_SPECS = {
    "wq": P(None, ATTN_TP, None),  # [H, heads, D]
    "wk": P(None, ATTN_TP, None),  # [H, kv_heads, D]
    "wv": P(None, ATTN_TP, None),  # [H, kv_heads, D]
    "wo": P(ATTN_TP, None, None),  # [heads, D, H]
}
_EXPERT_SPECS = {
    "ep": {  # whole experts per device
        "w_gate": P(mesh_lib.TP_AXES, None, None),
        "w_up": P(mesh_lib.TP_AXES, None, None),
        "w_down": P(mesh_lib.TP_AXES, None, None),
    },
    "none": {  # every expert, a slice of its hidden width per device
        "w_gate": P(None, None, mesh_lib.TP_AXES),
        "w_up": P(None, None, mesh_lib.TP_AXES),
        "w_down": P(None, mesh_lib.TP_AXES, None),
    },
}
KV_CACHE_SPEC = kv_cache_lib.KVCache(
    k=P(mesh_lib.DP_AXIS, None, None, ATTN_TP, None),  # [dp, layers, slots, kv_heads, D]
    v=P(mesh_lib.DP_AXIS, None, None, ATTN_TP, None),  # [dp, layers, slots, kv_heads, D]
    req_to_token=P(mesh_lib.DP_AXIS),  # [dp, max_reqs, max_context]
)


def _param_spec(path, _, moe_a2a_backend: str) -> P:
    names = [getattr(key, "key", getattr(key, "name", None)) for key in path]
    name = names[-1] if names[-1] != "value" else names[-2]
    if "experts" in names and name in _EXPERT_SPECS[moe_a2a_backend]:
        return _EXPERT_SPECS[moe_a2a_backend][name]
    return _HEAD_SPECS.get(name, P()) if "attn" in names else P()


def param_specs(params: Any, moe_a2a_backend: str) -> Any:
    """Partition specs of the model's parameter state (see the module docstring).

    Args:
      params: the ``nnx.State`` from ``nnx.split(model)``.
      moe_a2a_backend: "ep" or "none".

    Returns:
      A pytree of ``PartitionSpec`` shaped like ``params``.
    """
    spec = functools.partial(_param_spec, moe_a2a_backend=moe_a2a_backend)
    return jax.tree_util.tree_map_with_path(spec, params)


def _squeeze_rank(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _expand_rank(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[None], tree)


def _run_dense(model, parallel, inputs, context):
    for layer in model.layers:
        if not layer.is_moe:
            ops = layer_ops.dense_layer_operations(layer, parallel)
            inputs = operations.execute_operations(inputs, ops, context=context)
    return inputs


def _run_moe(model, parallel, mode, inputs, per_rank, replicated, box, child_capacity):
    moe_layers = [layer for layer in model.layers if layer.is_moe]
    if not moe_layers:
        return inputs
    config = model.config
    family = (
        strategy.LayerFamily.DEEPSEEK
        if config.num_shared_experts
        else strategy.LayerFamily.QWEN3_MOE
    )
    ops = [layer_ops.moe_layer_operations(layer, config, parallel) for layer in moe_layers]
    t, n = per_rank.get("split_token_index"), per_rank["num_tokens"]
    context = dict(
        attn_metadata=per_rank["attn_metadata"],
        dp_context=replicated["dp_context"],
        num_tokens=n,
        step_box=box,
    )
    child_contexts = (None, None)
    if child_capacity is not None:
        child_contexts = tuple(
            dict(attn_metadata=md, dp_context=ctx, num_tokens=count, step_box=box)
            for md, ctx, count in zip(
                per_rank["child_metadata"], replicated["child_dp_contexts"], (t, n - t), strict=True
            )
        )
    hidden, residual = layer_loop.model_forward_maybe_tbo(
        ops,
        child_capacity is not None,
        inputs["positions"],
        None,
        inputs["hidden_states"],
        inputs["residual"],
        tbo_split=None if child_capacity is None else layer_loop.TboSplit(t, n, child_capacity),
        context=context,
        child_contexts=child_contexts,
        family=family,
        forward_mode=mode,
    )
    return dict(hidden_states=hidden, residual=residual, positions=inputs["positions"])


def step_body(graphdef, parallel, mode, child_capacity, params, kv_cache, per_rank, replicated):
    """One DP rank's forward over local shards (the ``shard_map`` body).

    Args:
      graphdef: the model's ``nnx`` graph definition (static).
      parallel: ``layer_ops.ParallelConfig`` (static).
      mode: the global ``ForwardMode`` (picks the TBO strategy; static).
      child_capacity: TBO child rows, or None to run without TBO (static).
      params: the local parameter shards.
      kv_cache: this rank's ``KVCache`` with a leading axis of 1.
      per_rank: this rank's inputs with a leading axis of 1 (see ``make_step``).
      replicated: the DP contexts.

    Returns:
      ``(logits [1, capacity, vocab], kv_cache, overflow [])``.
    """
    model = nnx.merge(graphdef, params)
    per_rank = _squeeze_rank(per_rank)
    box = layer_ops.StepBox(_squeeze_rank(kv_cache))
    hidden = model.embed(per_rank["input_ids"])
    inputs = dict(
        hidden_states=hidden, residual=jnp.zeros_like(hidden), positions=per_rank["positions"]
    )
    context = dict(
        attn_metadata=per_rank["attn_metadata"],
        dp_context=replicated["dp_context"],
        num_tokens=per_rank["num_tokens"],
        step_box=box,
    )
    inputs = _run_dense(model, parallel, inputs, context)
    inputs = _run_moe(model, parallel, mode, inputs, per_rank, replicated, box, child_capacity)
    final = norm.rms_norm(
        inputs["hidden_states"] + inputs["residual"],
        model.final_norm.weight[...],
        model.config.rms_norm_eps,
    )
    overflow = jax.lax.psum(box.overflow, mesh_lib.TP_AXES)
    return _expand_rank(model.lm_head(final)), _expand_rank(box.kv_cache), overflow


def make_step(
    model: model_lib.MoEModel,
    mesh: jax.sharding.Mesh,
    parallel: layer_ops.ParallelConfig,
) -> "Step":
    """Builds the jitted step for a model on a mesh.

    Args:
      model: the model (its graph structure is fixed; parameters are passed per call).
      mesh: the ``("dp", "attn_tp")`` mesh.
      parallel: layout options.

    Returns:
      A ``Step``: ``step(params, kv_cache, per_rank, replicated, *, mode, child_capacity)``
      -> ``(logits, kv_cache, overflow)``; ``kv_cache`` is donated. ``per_rank`` holds
      ``input_ids``, ``positions`` ``[dp, capacity]``, ``num_tokens`` ``[dp]``,
      ``attn_metadata`` (stacked) and, with TBO, ``split_token_index`` ``[dp]`` and
      ``child_metadata`` (A, B); ``replicated`` holds ``dp_context`` and, with TBO,
      ``child_dp_contexts`` (A, B). ``mode`` and ``child_capacity`` (None: no TBO) are
      static: one compile per (bucket, mode, TBO).
    """
    graphdef, params = nnx.split(model)
    specs = param_specs(params, parallel.moe_a2a_backend)

    def step(params, kv_cache, per_rank, replicated, *, mode, child_capacity):
        body = functools.partial(
            step_body, graphdef, parallel, forward_mode_lib.ForwardMode(mode), child_capacity
        )
        in_specs = (
            specs,  # params: heads over attn_tp, experts over the TP group
            KV_CACHE_SPEC,  # kv_cache: one pool per DP rank, kv heads over attn_tp
            P(mesh_lib.DP_AXIS),  # per_rank: leading dp axis
            P(),  # replicated: DP contexts
        )
        out_specs = (P(mesh_lib.DP_AXIS), KV_CACHE_SPEC, P())
        return jax.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )(params, kv_cache, per_rank, replicated)

    jit = functools.partial(
        jax.jit, static_argnames=("mode", "child_capacity"), donate_argnames=("kv_cache",)
    )
    plain = jit(step)
    # XLA:GPU would merge the micro-batches' matmuls and collectives back together.
    gpu = mesh_lib.mesh_platform(mesh) in ("gpu", "cuda")
    overlapped = jit(step, compiler_options=xla_options.tbo_compiler_options()) if gpu else plain
    return Step(plain, overlapped)


class Step:
    """The jitted step: the plain program, and the TBO one compiled with TBO XLA options."""

    def __init__(self, plain, overlapped):
        """Args: plain: jitted step for non-TBO keys; overlapped: jitted step for TBO keys."""
        self.plain, self.overlapped = plain, overlapped

    def jitted(self, child_capacity: int | None):
        """The jitted function that serves a step with this TBO child capacity (None: no TBO)."""
        return self.plain if child_capacity is None else self.overlapped

    def __call__(self, params, kv_cache, per_rank, replicated, *, mode, child_capacity):
        """Runs the step (see ``make_step``)."""
        return self.jitted(child_capacity)(
            params, kv_cache, per_rank, replicated, mode=mode, child_capacity=child_capacity
        )

    def compile_count(self) -> int:
        """Programs compiled so far over both jitted functions."""
        count = self.plain._cache_size()
        return count if self.overlapped is self.plain else count + self.overlapped._cache_size()
