"""Overlap coverage of the model's own step, compiled for N x H200 on the CPU.

Builds the same jitted ``shard_map`` step the runner serves, for a mesh of described H200s
(``jtbo.aot.gpu_mesh``), with abstract parameters (``nnx.eval_shape``: no memory) and the
arrays of a real host plan (``planning.plan_step`` over synthetic EXTEND or DECODE batches),
then measures it with ``jtbo.analysis.report.overlap_report``. Needs the ``aot`` extra and
``JAX_PLATFORMS=cpu``.

With ``tbo_round_barriers=False`` and the step's per-micro-batch embedding, dense layers and
LM head, TBO covers every collective of the step from 16 tokens per DP rank on, except one of
the small overflow / peak-load reductions, which stay outside both micro-batches so that every
process reads the same counts. The figures and the fixes that got there: docs/benchmarks/,
"The model's own step", 4 x 2 H200 compile on the CPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtbo import aot, split
from jtbo.analysis import report
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import layer_ops, step
from jtbo.models import model as model_lib
from jtbo.runner import planning, runner_config, tbo_options

ForwardMode = split.ForwardMode


def _synthetic(mode: ForwardMode, tokens: int, num_seqs: int) -> split.ForwardBatch:
    if mode.is_decode():
        seq = np.arange(tokens)
        return split.ForwardBatch(
            forward_mode=mode, batch_size=tokens, input_ids=np.zeros(tokens, np.int32),
            positions=seq,
            out_cache_loc=seq + 1, req_pool_indices=seq, seq_lens=np.full(tokens, 8),
        )  # fmt: skip
    lens = np.full(num_seqs, tokens // num_seqs)
    lens[0] += tokens - lens.sum()
    return split.ForwardBatch(
        forward_mode=mode, batch_size=num_seqs, input_ids=np.zeros(tokens, np.int32),
        positions=np.arange(tokens), out_cache_loc=np.arange(tokens) + 1,
        req_pool_indices=np.arange(num_seqs), seq_lens=lens, extend_seq_lens=lens,
        extend_prefix_lens=np.zeros(num_seqs, np.int32),
    )  # fmt: skip


def _abstract(tree, mesh, spec_tree):
    def one(x, spec):
        return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype")
                                    else x.dtype, sharding=NamedSharding(mesh, spec))  # fmt: skip

    return jax.tree.map(one, tree, spec_tree)


def model_overlap_report(
    config: config_lib.MoEConfig,
    *,
    dp_size: int,
    attn_tp_size: int,
    mode: ForwardMode,
    tokens_per_rank: int,
    enable_tbo: bool = True,
    moe: layer_ops.MoEOptions | None = None,
    dtype=jnp.bfloat16,
) -> report.OverlapReport:
    """Compiles one model step for ``dp_size * attn_tp_size`` H200s and measures overlap.

    Args:
      config: the model shapes.
      dp_size: DP ranks; attn_tp_size: devices per DP rank.
      mode: EXTEND (prefill strategy) or DECODE (decode strategy).
      tokens_per_rank: tokens (EXTEND, in 4 sequences) or sequences (DECODE) per DP rank.
      enable_tbo: compile the TBO step (False: the plain step, coverage 0 by definition).
      moe: the MoE options (``model_step_program``); None: their defaults.
      dtype: parameter / activation dtype.

    Returns:
      The ``OverlapReport``.

    Raises:
      jtbo.aot.AotUnavailableError: the ``aot`` extra is missing.
      ValueError: the plan cannot run TBO although asked to.
    """
    mesh = h200_mesh(dp_size, attn_tp_size)
    jitted, args, compiler_options = model_step_program(
        config, mesh, mode=mode, tokens_per_rank=tokens_per_rank, enable_tbo=enable_tbo,
        moe=moe, dtype=dtype,
    )  # fmt: skip
    return report.overlap_report(jitted, args, compiler_options=compiler_options)


def h200_mesh(dp_size: int, attn_tp_size: int) -> jax.sharding.Mesh:
    """A ``("dp", "attn_tp")`` mesh of described H200s with Auto axes (AOT compiles only)."""
    gpus = aot.gpu_mesh((dp_size, attn_tp_size), mesh_lib.TP_AXES)
    return jax.sharding.Mesh(
        gpus.devices, mesh_lib.TP_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


def model_step_program(
    config: config_lib.MoEConfig,
    mesh: jax.sharding.Mesh,
    *,
    mode: ForwardMode,
    tokens_per_rank: int,
    enable_tbo: bool,
    seq_capacity: int | None = None,
    moe: layer_ops.MoEOptions | None = None,
    dtype=jnp.bfloat16,
    tbo_issue_barriers: bool | None = None,
    tbo_round_barriers: bool = False,
):
    """The runner's jitted step and abstract arguments (no parameter memory) for one plan, in
    which every DP rank runs the same synthetic batch (``tokens_per_rank`` tokens in 4
    sequences, or that many decode sequences), under the ``RunnerConfig`` a runner resolves.

    Args:
      config: the model shapes.
      mesh: a ``("dp", "attn_tp")`` mesh (``h200_mesh`` for AOT, or real devices).
      mode: EXTEND or DECODE.
      tokens_per_rank: tokens or sequences per DP rank (also the token bucket).
      enable_tbo: plan with two-batch overlap.
      seq_capacity: sequences a step may hold (sizes the attention tiles); by default
        ``tokens_per_rank``.
      moe: the MoE options (``layer_ops.MoEOptions``); None: their defaults.
        ``moe_runner_backend=None`` compiles the "xla" experts (the AOT program's devices are
        described, not present, so no platform default is resolved).
      dtype: parameter / activation dtype.
      tbo_issue_barriers, tbo_round_barriers: the ``TboOptions`` fields.

    Returns:
      ``(jitted_step, abstract_args, compiler_options)``: the runner compiles
      ``jitted_step.lower(*abstract_args)`` with ``compiler_options``
      (``step.step_compiler_options``). The args are the parameters, the KV cache and the
      plan's two packed buffers (``step.pack_step_inputs``), as the runner passes them.

    Raises:
      ValueError: the plan cannot run TBO although asked to.
    """
    dp_size = mesh.shape[mesh_lib.DP_AXIS]
    model = _abstract_model(config, dtype)
    seq_capacity = seq_capacity or tokens_per_rank
    tbo = tbo_options.TboOptions(
        enable_two_batch_overlap=enable_tbo, tbo_issue_barriers=tbo_issue_barriers,
        tbo_round_barriers=tbo_round_barriers,
    )  # fmt: skip
    resolved = _runner_config(config, mesh, moe, tokens_per_rank, seq_capacity, dtype, tbo)
    parallel, moe = resolved.parallel, resolved.parallel.moe
    plan = _synthetic_plan(ForwardMode(mode), dp_size, tokens_per_rank, resolved.plan)
    _, params = step.split_params(model)
    inputs = step.pack_step_inputs(plan.per_rank, plan.replicated)
    args = (
        _abstract(params, mesh, step.param_specs(params, moe.moe_a2a_backend)),
        _abstract_kv_cache(config, mesh, dp_size, tokens_per_rank, seq_capacity, dtype),
        _abstract(inputs.per_rank, mesh, P(mesh_lib.DP_AXIS)),  # [dp, n] int32
        _abstract(inputs.replicated, mesh, P()),  # [m] int32
    )
    jitted = _jitted_step(step.make_step(model, mesh, parallel), plan, inputs)
    return jitted, args, step.step_compiler_options(mesh, plan.child_capacity)


def _jitted_step(built: step.Step, plan: planning.StepPlan, inputs: step.StepInputs):
    """The jitted program of ``plan``'s compile key."""
    dispatchers = built.dispatchers.for_step(plan.capacity, plan.child_capacity)
    key = built.key(
        inputs, mode=int(plan.mode), child_capacity=plan.child_capacity, dispatchers=dispatchers
    )
    return built.jitted(key)


def _abstract_model(config: config_lib.MoEConfig, dtype) -> model_lib.MoEModel:
    """The model of ``config`` in ``dtype`` as shapes only (no parameter memory)."""
    return nnx.eval_shape(
        lambda: model_lib.cast(model_lib.MoEModel(config, rngs=nnx.Rngs(0)), dtype)
    )


def _runner_config(config, mesh, moe, tokens_per_rank: int, seq_capacity: int, dtype, tbo):
    """The ``RunnerConfig`` a runner of one bucket of ``tokens_per_rank`` tokens would resolve:
    ``moe`` (defaults if None) with the "xla" experts unless given, and the native attention
    (the devices are described, not present: no platform default resolves)."""
    moe = moe or layer_ops.MoEOptions()
    moe = dataclasses.replace(moe, moe_runner_backend=moe.moe_runner_backend or "xla")
    context = _max_context(tokens_per_rank)
    return runner_config.resolve(
        config, mesh, max_total_tokens=context, max_running_requests=seq_capacity,
        max_context_len=context, moe=moe, tbo=tbo, token_buckets=(tokens_per_rank,),
        dtype=dtype, attention_backend="native",
    )  # fmt: skip


def _max_context(tokens_per_rank: int) -> int:
    return tokens_per_rank + 16


def _synthetic_plan(
    mode: ForwardMode, dp_size: int, tokens_per_rank: int, options: planning.PlanOptions
) -> planning.StepPlan:
    """The host plan of every DP rank running the same synthetic batch."""
    plan = planning.plan_step([_synthetic(mode, tokens_per_rank, 4)] * dp_size, options)
    if options.enable_tbo and plan.child_capacity is None:
        raise ValueError(f"the synthetic {mode.name} plan cannot run TBO")
    return plan


def _abstract_kv_cache(config, mesh, dp_size: int, tokens_per_rank: int, seq_capacity: int, dtype):
    """``ShapeDtypeStruct``s of the KV pools and page table, sharded like the runner's."""
    max_context = _max_context(tokens_per_rank)
    heads, k_dim, v_dim = config.kv_pool_heads(mesh.shape["attn_tp"])
    pool = (dp_size, config.num_layers, max_context + 1, heads)
    specs = step.KV_CACHE_SPEC
    return kv_cache_lib.KVCache(
        k=jax.ShapeDtypeStruct((*pool, k_dim), dtype, sharding=NamedSharding(mesh, specs.k)),
        v=jax.ShapeDtypeStruct((*pool, v_dim), dtype, sharding=NamedSharding(mesh, specs.v))
        if v_dim
        else None,  # MLA: no value pool
        req_to_token=jax.ShapeDtypeStruct(
            (dp_size, seq_capacity, max_context), jnp.int32,
            sharding=NamedSharding(mesh, specs.req_to_token),
        ),
    )  # fmt: skip
