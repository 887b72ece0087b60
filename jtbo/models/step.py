"""The sharded model step: one jitted ``jax.shard_map`` over the ``("dp", "attn_tp")`` mesh.

Body (local shards, per DP rank): the operation list of ``jtbo.models.step_operations``
(embedding -> dense layers -> MoE layers in the strategy layout of the global forward mode ->
final norm -> LM head), either over the whole batch (``execute_operations``) or, with two-batch
overlap, over two micro-batches: ``input_ids`` and ``positions`` are cut at the traced split
token index into two zero-padded children (``jtbo.split.split_inputs``), run staggered
(``execute_overlapped_operations``; on a one-device mesh, with nothing to exchange, in lockstep
with the routed experts run once for both: ``execute_lockstep_operations``), and the children's
logits are written back at their parent offsets (``jtbo.split.merge_outputs``). Unlike SGLang,
the dense layers, the embedding and the LM head run per micro-batch too, so that every
collective of the step has the other micro-batch's compute to hide under (``step_operations``
says why). The KV cache is threaded through micro-batch A's and then B's attention of every
layer (``layer_ops.StepBox``). Each micro-batch has its own EP dispatcher
(``jtbo.models.ep_dispatchers``).

Per-rank inputs carry a leading ``dp`` axis (sharded over ``"dp"``, replicated over
``"attn_tp"``); DP contexts are replicated. Parameters are sharded by ``param_specs``:
attention heads over ``attn_tp``; routed experts over all devices by expert (``ep``) or by
their hidden width (``none``); everything else replicated. The step returns logits
``[dp, capacity, vocab]`` (float32) or, when the plan carries ``logit_rows`` ``[dp, width]``
(the rows a sampler reads), ``[dp, width, vocab]``: the operation
lists then end with the final norm, the picked rows' hidden states are read from the batch (or
from both micro-batches, ``activations.take_merged_rows``) and the LM head runs once, on those
rows only (a prefill's LM head over every token is most of its epilogue, and a TBO step would
merge ``[capacity, vocab]`` float32 logits). The step also returns the updated KV cache and,
per dispatcher, the (peer, expert) counts of routed assignments dropped for lack of EP
capacity, summed over devices, and their peak loads, max over devices (the host applies
``collectives.resolve_overflow``; it never takes a step with any overflow).

The host plan reaches the step packed (``pack_step_inputs``, ``jtbo.split.packing``): the
per-rank arrays as one ``[dp, n]`` int32 buffer (sharded over ``"dp"``), the replicated ones as
one ``[m]`` buffer, so a step makes two host->device transfers instead of one per leaf (their
cost: docs/benchmarks/, "TBO step cost on one H200", fused weights and one CUDA graph per
step). Each DP rank unpacks its row inside the ``shard_map`` body with static slices and bitcasts.

Compiles: one per (token bucket, plan layouts, mode, TBO child capacity, dispatchers). Each
such key gets its own jitted function guarded by ``chex.assert_max_traces(n=1)``, so a step
that would retrace within a key (buffers or a cache the key does not describe) fails loudly.
"""

import dataclasses
import functools
import itertools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.collectives import mesh as mesh_lib
from jtbo.kernels import fp8_blocks
from jtbo.models import (
    ep_dispatchers,
    experts,
    layer_ops,
    layer_state,
    plan_arrays,
    step_io,
    step_operations,
)
from jtbo.models import model as model_lib
from jtbo.overlap import operations, xla_options
from jtbo.split import activations, packing
from jtbo.split import forward_mode as forward_mode_lib

ATTN_TP = mesh_lib.ATTN_TP_AXIS
_HEAD_SPECS = {
    "wqkv": P(None, ATTN_TP, None, None),  # [H, kv_heads, group + 2, D]
    "wo": P(ATTN_TP, None, None),  # [heads, D, H]
    "bqkv": P(ATTN_TP, None, None),  # [kv_heads, group + 2, D]
    "wq": P(None, ATTN_TP, None),  # MLA [H, heads, nope + rope]
    "wq_b": P(None, ATTN_TP, None),  # MLA [q_lora_rank, heads, nope + rope]
    "wkv_b": P(None, ATTN_TP, None),  # MLA [kv_lora_rank, heads, nope + v]
}
_TP = mesh_lib.TP_AXES
_EXPERT_SPECS = {  # the routed experts' float parameters, by moe_a2a_backend
    "ep": {  # whole experts per device
        "w_gate_up": P(_TP, None, None, None),  # [E, H, 2, F]
        "w_down": P(_TP, None, None),  # [E, F, H]
    },
    "none": {  # every expert, a slice of its hidden width F per device
        "w_gate_up": P(None, None, None, _TP),  # [E, H, 2, F]
        "w_down": P(None, _TP, None),  # [E, F, H]
    },
}
KV_CACHE_SPEC = kv_cache_lib.KVCache(
    # GQA: kv heads over attn_tp. MLA: one latent copy per attn_tp rank ("heads" = attn_tp).
    k=P(mesh_lib.DP_AXIS, None, None, ATTN_TP, None),  # [dp, layers, slots, kv_heads, D]
    v=P(mesh_lib.DP_AXIS, None, None, ATTN_TP, None),  # [dp, layers, slots, kv_heads, Dv]
    req_to_token=P(mesh_lib.DP_AXIS),  # [dp, max_reqs, max_context]
)


def _named(mesh: jax.sharding.Mesh, spec: P) -> jax.sharding.NamedSharding:
    """``spec`` on ``mesh``, spelled without trailing None (as XLA spells the outputs)."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return jax.sharding.NamedSharding(mesh, P(*parts))


def kv_cache_shardings(mesh: jax.sharding.Mesh) -> kv_cache_lib.KVCache:
    """``KV_CACHE_SPEC`` on ``mesh``: the shardings of the K/V pools and the page table.

    The runner creates its pools with these, and every step returns its pools with exactly
    these (``jax.jit(out_shardings=...)``): an equal sharding spelled otherwise (XLA drops a
    size-1 ``attn_tp`` axis from its outputs' specs) gives a program a second dispatch-cache
    entry when it first receives the pools a step returned (no second XLA compile, but
    ``ModelRunner.compile_count``, which counts those entries, counted the program twice).

    Args:
      mesh: the runner's ``("dp", "attn_tp")`` mesh.

    Returns:
      A ``KVCache`` of ``NamedSharding`` (``v`` too, also for an MLA cache that has none).
    """
    return jax.tree.map(functools.partial(_named, mesh), KV_CACHE_SPEC)


def _expert_spec(name: str, leaf, moe_a2a_backend: str) -> P | None:
    """The spec of a routed-expert parameter (None for another name). FP8 experts store their
    values contraction-last (``fp8_blocks.expert_axes``; ``jtbo.models.experts``), so their
    spec is the float one in that order; their block scales (``*_scale``, FP8 only) are
    sharded as their values."""
    spec = _EXPERT_SPECS[moe_a2a_backend].get(name.removesuffix("_scale"))
    fp8 = name.endswith("_scale") or jnp.dtype(leaf.dtype) == fp8_blocks.FP8_DTYPE
    if spec is None or not fp8:
        return spec
    return P(*(spec[axis] for axis in fp8_blocks.expert_axes(len(spec))))


def _param_spec(path, leaf, moe_a2a_backend: str) -> P:
    names = [getattr(key, "key", getattr(key, "name", None)) for key in path]
    name = names[-1] if names[-1] != "value" else names[-2]
    spec = _expert_spec(name, leaf, moe_a2a_backend) if "experts" in names else None
    if spec is not None:
        return spec
    return _HEAD_SPECS.get(name, P()) if "attn" in names else P()


def split_params(model: model_lib.MoEModel) -> tuple[nnx.GraphDef, dict]:
    """The model's graph definition and its parameters in the form the step takes them.

    The parameters are nested plain dicts of arrays (``nnx.to_pure_dict``), which
    ``nnx.merge`` accepts as they are. jit flattens its arguments at every call; plain dicts
    flatten in its C++ dispatch path, where an ``nnx.State`` calls back into Python for every
    variable (host time on every step: docs/benchmarks/, "The host's share of a decode step").

    Args:
      model: the model.

    Returns:
      ``(graphdef, params)``.
    """
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def param_specs(params: Any, moe_a2a_backend: str) -> Any:
    """Partition specs of the model's parameters (see the module docstring).

    Args:
      params: the parameters from ``split_params`` (or the ``nnx.State`` of ``nnx.split``).
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


def _contexts(per_rank, replicated, box, dispatchers, child_capacity):
    """Read-only state entries (``layer_state.MicroBatchContext``): ``[whole batch]`` without
    TBO, ``[A, B]`` with it."""
    dispatchers = dispatchers or (None, None)
    if child_capacity is None:
        return [
            layer_state.MicroBatchContext(
                attn_metadata=per_rank.attn_metadata,
                dp_context=replicated.dp_context,
                num_tokens=per_rank.num_tokens,
                micro_batch=0,
                ep_dispatcher=dispatchers[0],
                step_box=box,
            )
        ]
    t, n = per_rank.split_token_index, per_rank.num_tokens
    return [
        layer_state.MicroBatchContext(
            attn_metadata=per_rank.child_metadata[i],
            dp_context=replicated.child_dp_contexts[i],
            num_tokens=count,
            micro_batch=i,
            ep_dispatcher=dispatchers[i],
            step_box=box,
        )
        for i, count in enumerate((t, n - t))
    ]


def _micro_batch_operations(operations_of, params, children, isolate: bool):
    """Each micro-batch's inputs and ``(operations, delta)`` (``_run_tbo``).

    With ``isolate`` each micro-batch reads the parameters through its own
    ``optimization_barrier``, tied to its inputs; without it one operation list serves both.
    """
    if not isolate:
        return children, [operations_of(params)] * 2
    pairs = [jax.lax.optimization_barrier((params, child)) for child in children]
    return [child for _, child in pairs], [operations_of(view) for view, _ in pairs]


def _run_lockstep(children, operation_lists, contexts, barriers: bool, child_capacity: int):
    """Both micro-batches in lockstep (``_run_tbo`` on a one-device mesh); small ones also run
    their row-wise operations once over both."""
    return operations.execute_lockstep_operations(
        children, operation_lists, contexts_arr=contexts, barriers=barriers,
        join_row_wise=child_capacity <= SINGLE_DEVICE_MERGE_MAX_ROWS,
        state_type=layer_state.LayerState,
    )  # fmt: skip


def _run_tbo(
    operations_of, params, per_rank, contexts, child_capacity, barriers, isolate, issue_barriers,
    pin_issued,
):  # fmt: skip
    """Both micro-batches staggered (or in lockstep); their outputs merged back at the parent
    offsets (or, for a step with ``logit_rows``, the final hidden states of those rows read
    from both).

    Without ``isolate`` (one-device meshes: nothing is exchanged, so staggering hides nothing)
    the micro-batches run in lockstep, operation by operation, and operations with a joint form
    once for both (``operations.execute_lockstep_operations``): the routed experts then run one
    grouped GEMM over both micro-batches' rows, which reads each expert weight once, as the
    plain step does. Micro-batches of at most ``SINGLE_DEVICE_MERGE_MAX_ROWS`` rows (bound by
    launches and weight reads, not by compute) also run the row-wise operations (norms,
    projections, router gate, shared experts) once over both (``jtbo.overlap.row_joint``).

    ``operations_of(params) -> (ops, delta)`` builds one micro-batch's operation list over a
    view of the parameters. Where one micro-batch's exchange must run beside the other's
    compute (multi-device meshes):

    * ``isolate``: the staggered executor, and each micro-batch reads the parameters through
      its own ``optimization_barrier`` (tied to its own inputs). Over shared parameter buffers XLA's
      sibling multi-output fusion joined A's and B's small ops that read the same weight
      (routing, dispatch bookkeeping), so A's dispatch depended on B's gate and routing, and
      no schedule could put B's attention beside A's exchange;
    * ``issue_barriers`` (only with ``isolate``): every collective-issuing operation
      (``*_a``) first passes both micro-batches' live arrays, the other one's in-flight
      collective results included, through one barrier
      (``execute_overlapped_operations(issue_barriers=True)``). The collective's input is
      then ready before the other micro-batch's next stage starts, and the other's exchange
      ends before this one is issued (XLA keeps one collective in flight anyway), so each
      exchange window holds the other micro-batch's whole stage;
    * ``pin_issued`` (only with ``isolate``; the peer-copy EP exchange): every issuing
      operation is followed by a barrier over both micro-batches' live arrays, in-flight
      exchanges included. XLA's scheduler sees the exchange's start as an ordinary call and
      could run the other micro-batch's stage first; the barrier orders the start before it.

    Both fill each exchange window with the other micro-batch's compute, in the compiled
    schedule and at run time (docs/benchmarks/, "Run-time overlap on two H200s"). One
    device has nothing to hide, and there A's and B's matmuls may merge
    (``step_compiler_options``).
    """
    t, n = per_rank.split_token_index, per_rank.num_tokens
    inputs = dict(input_ids=per_rank.input_ids, positions=per_rank.positions)
    children = activations.split_inputs(inputs, t, n, child_capacity=child_capacity)
    children, built = _micro_batch_operations(operations_of, params, children, isolate)
    if isolate:
        outputs = operations.execute_overlapped_operations(
            children, [ops for ops, _ in built], [0, built[0][1]], contexts_arr=contexts,
            barriers=barriers, issue_barriers=issue_barriers, pin_issued=pin_issued,
            state_type=layer_state.LayerState,
        )  # fmt: skip
    else:
        lists = [ops for ops, _ in built]
        outputs = _run_lockstep(children, lists, contexts, barriers, child_capacity)
    if per_rank.logit_rows is not None:
        return activations.take_merged_rows(*outputs, t, per_rank.logit_rows)
    capacity = per_rank.input_ids.shape[0]
    return activations.merge_outputs(*outputs, t, n, out_len=capacity)


def step_body(
    graphdef, parallel, mode, child_capacity, dispatchers, params, kv_cache, per_rank, replicated,
    prev_tokens=None, *, isolate_micro_batches: bool = False, sampler_key=None,
):  # fmt: skip
    """One DP rank's forward over local shards (the ``shard_map`` body).

    Args:
      graphdef: the model's ``nnx`` graph definition (static).
      parallel: ``layer_ops.ParallelConfig`` (static).
      mode: the global ``ForwardMode`` (picks the TBO strategy; static).
      child_capacity: TBO child rows, or None to run without TBO (static).
      dispatchers: EP dispatchers, one per micro-batch (None without EP; static).
      params: the local parameter shards.
      kv_cache: this rank's ``KVCache`` with a leading axis of 1.
      per_rank: this rank's inputs with a leading axis of 1 (see ``make_step``).
      replicated: the DP contexts.
      prev_tokens: ``[1, rows]`` the previous step's token output on this rank, read by the
        rows ``per_rank.token_source`` names (``step_io.resolve_input_ids``); None when the
        plan has no ``token_source``.
      isolate_micro_batches: run A and B staggered and kept apart for run-time overlap (TBO on
        multi-device meshes); False runs them in lockstep, joint operations once for both
        (one-device meshes; ``_run_tbo``).
      sampler_key: a ``step_io.SamplerKey`` to return token ids instead of logits (static).

    Returns:
      ``(logits [1, rows, vocab], kv_cache, overflow [micro-batches, 2],
      peak_load [micro-batches, 2])``: ``rows`` is the capacity, or the width of
      ``per_rank.logit_rows`` when the plan has it. With ``sampler_key`` the first item is
      ``step_io.step_output``'s dict instead, each leaf with a leading axis of 1.
    """
    per_rank, cache = _apply_plan(_squeeze_rank(per_rank), _squeeze_rank(kv_cache), prev_tokens)
    box = layer_ops.StepBox(cache, 1 if child_capacity is None else 2)
    rows = per_rank.logit_rows  # [width] rows to return, or None: every row

    def operations_of(view):
        model = nnx.merge(graphdef, view)
        return step_operations.step_operations(model, parallel, mode, lm_head=rows is None)

    contexts = _contexts(per_rank, replicated, box, dispatchers, child_capacity)
    if child_capacity is None:
        out = _run_plain(operations_of(params)[0], per_rank, contexts[0])
    else:
        out = _run_tbo(
            operations_of, params, per_rank, contexts, child_capacity,
            parallel.tbo_round_barriers, isolate_micro_batches, parallel.issue_barriers,
            parallel.moe.moe_a2a_backend == "ep" and parallel.moe.exchange(True) == "peer_copy",
        )  # fmt: skip
    # With logit_rows the LM head runs once, on the picked rows' final hidden states.
    logits = (
        out["logits"] if rows is None else nnx.merge(graphdef, params).logits(out["hidden_states"])
    )
    if sampler_key is not None:
        logits = step_io.step_output(logits, per_rank.sampling, sampler_key)
    return _expand_rank(logits), _expand_rank(box.kv_cache), *_ep_counts(box)


def _apply_plan(per_rank: plan_arrays.PerRankInputs, cache, prev_tokens):
    """Writes the new tokens' page-table slots and reads the input ids the previous step
    sampled on the devices: ``(per_rank, cache)`` as the layers read them."""
    if per_rank.page_writes is not None:  # the new tokens' slots, before attention reads them
        table = step_io.write_pages(cache.req_to_token, per_rank.page_writes)
        cache = dataclasses.replace(cache, req_to_token=table)
    if per_rank.token_source is not None:  # rows whose ids the last step sampled on the devices
        ids = step_io.resolve_input_ids(per_rank.input_ids, per_rank.token_source, prev_tokens[0])
        per_rank = dataclasses.replace(per_rank, input_ids=ids)
    return per_rank, cache


def _run_plain(ops, per_rank: plan_arrays.PerRankInputs, context):
    """The whole batch through ``ops`` at once; only the ``logit_rows`` rows kept, if given."""
    inputs = dict(input_ids=per_rank.input_ids, positions=per_rank.positions)
    out = operations.execute_operations(
        inputs, ops, context=context, state_type=layer_state.LayerState
    )
    if per_rank.logit_rows is None:
        return out
    return jax.tree.map(lambda x: x[per_rank.logit_rows], out)


def _ep_counts(box: layer_ops.StepBox) -> tuple[jax.Array, jax.Array]:
    """The step's EP overflow counts (summed) and peak loads (max) over the EP group.

    Reduced over the group so every process reads the same counts (16 bytes each; the only
    collectives outside both micro-batches).
    """
    overflow = jax.lax.psum(jnp.stack(box.overflow), mesh_lib.TP_AXES)
    peak_load = jax.lax.pmax(jnp.stack(box.peak_load), mesh_lib.TP_AXES)
    return overflow, peak_load


def make_step(
    model: model_lib.MoEModel,
    mesh: jax.sharding.Mesh,
    parallel: layer_ops.ParallelConfig,
) -> "Step":
    """Builds the step of a model on a mesh (jitted per compile key, see ``Step``).

    Args:
      model: the model (its graph structure is fixed; parameters are passed per call).
      mesh: the ``("dp", "attn_tp")`` mesh.
      parallel: layout options.

    Returns:
      A ``Step``: ``step(params, kv_cache, inputs, *, mode, child_capacity, dispatchers,
      sampler=None, prev_tokens=None)`` -> ``(logits, kv_cache, overflow, peak_load)`` (with a
      ``step_io.SamplerKey`` ``sampler``: token outputs in place of the logits,
      ``step_io.step_output``); ``params`` are as ``split_params`` gives
      them; ``kv_cache`` is donated; ``inputs`` is
      ``pack_step_inputs(per_rank, replicated)`` (host buffers, or placed with ``Step.put``).
      ``per_rank`` (a ``plan_arrays.PerRankInputs``; fields not given are None) holds
      ``input_ids``, ``positions`` ``[dp, capacity]``, ``num_tokens``
      ``[dp]`` and, without TBO, ``attn_metadata`` (stacked) or, with TBO,
      ``split_token_index`` ``[dp]`` and ``child_metadata`` (A, B), and optionally
      ``logit_rows`` ``[dp, width]`` (the logits rows to compute), ``page_writes``
      ``[dp, 3, capacity]`` (written into the page table first, ``step_io.write_pages``),
      ``token_source`` ``[dp, capacity]`` (rows of ``prev_tokens`` ``[dp, rows]`` that give
      input ids) and ``sampling`` (each ``[dp, rows]``, with a sampling ``sampler``);
      ``replicated`` (a ``plan_arrays.ReplicatedInputs``) holds ``dp_context`` and, with
      TBO, ``child_dp_contexts`` (A, B). ``mode``, ``child_capacity`` (None: no TBO) and
      ``dispatchers`` are static. ``overflow`` (dropped assignments) and ``peak_load`` (the
      capacities needed) are ``[len(dispatchers), 2]`` (1 without EP).

    Raises:
      ValueError: FP8 experts whose blocks a device's shard would cut
        (``experts.check_expert_shards``).
    """
    experts.check_expert_shards(model.config, parallel.moe.moe_a2a_backend, mesh.size)
    graphdef, params = split_params(model)
    specs = param_specs(params, parallel.moe.moe_a2a_backend)
    table = ep_dispatchers.DispatcherTable(mesh, model.config, parallel)
    return Step(functools.partial(_sharded_step, graphdef, parallel, mesh, specs), mesh, table)


def step_parallel(
    parallel: layer_ops.ParallelConfig, child_capacity: int | None
) -> layer_ops.ParallelConfig:
    """The layout one compiled step runs: a TBO step's experts take
    ``MoEOptions.tbo_runner_backend``, a plain step's ``moe_runner_backend``.

    Args:
      parallel: the runner's layout.
      child_capacity: TBO child rows, or None for a plain step.

    Returns:
      ``parallel``, its ``moe.moe_runner_backend`` replaced for a TBO step.
    """
    if child_capacity is None:
        return parallel
    moe = dataclasses.replace(parallel.moe, moe_runner_backend=parallel.moe.tbo_runner_backend())
    return dataclasses.replace(parallel, moe=moe)


def _sharded_step(
    graphdef, parallel, mesh, specs, params, kv_cache, per_rank_words, replicated_words,
    prev_tokens=None, *, key,
):  # fmt: skip
    """The ``shard_map`` of ``step_body`` over packed plan buffers for one compile key.

    ``per_rank_words`` is ``[dp, n]`` int32 and ``replicated_words`` ``[m]`` int32
    (``pack_step_inputs``); each DP rank unpacks its ``[1, n]`` row with ``key.layouts``.
    """
    per_rank_layout, replicated_layout = key.layouts
    parallel = step_parallel(parallel, key.child_capacity)

    def body(params, kv_cache, per_rank_words, replicated_words, prev_tokens):
        per_rank = packing.unpack(per_rank_words, per_rank_layout)  # leaves [1, ...]
        replicated = packing.unpack(replicated_words, replicated_layout)
        if mesh.devices.size > 1:
            # Every input as its own buffer. Read straight out of the packed words, micro-batch
            # A's and B's small ops share one operand, and XLA's sibling multi-output fusion
            # then joins them (e.g. both combines' reductions into one kernel), so neither
            # micro-batch's next collective has the other's work left to hide under: attn_tp
            # all-gathers turn synchronous and the decode step's coverage falls. One device
            # has no collective to hide, and there the joined kernels are fewer launches.
            per_rank, replicated = jax.lax.optimization_barrier((per_rank, replicated))
        return step_body(
            graphdef, parallel, key.mode, key.child_capacity, key.dispatchers, params,
            kv_cache, per_rank, replicated, prev_tokens,
            isolate_micro_batches=mesh.devices.size > 1, sampler_key=key.sampler,
        )  # fmt: skip

    in_specs = (
        specs,  # params: heads over attn_tp, experts over the TP group
        KV_CACHE_SPEC,  # kv_cache: one pool per DP rank, kv heads over attn_tp
        P(mesh_lib.DP_AXIS),  # per_rank_words [dp, n]: one row per DP rank
        P(),  # replicated_words [m]: DP contexts
        P(mesh_lib.DP_AXIS),  # prev_tokens [dp, rows] (or None): the last step's tokens
    )
    out_specs = (
        P(mesh_lib.DP_AXIS),  # logits [dp, capacity or logit_rows width, vocab] or tokens
        KV_CACHE_SPEC,  # the updated pools
        P(),  # overflow [micro-batches, 2], summed over every device
        P(),  # peak_load [micro-batches, 2], max over every device
    )
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        params, kv_cache, per_rank_words, replicated_words, prev_tokens
    )


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """A step's plan arrays, each sharding group packed into one int32 buffer.

    Attributes:
      per_rank: ``[rows, n]`` int32, the per-rank arrays (``rows``: DP ranks; on the host of a
        multi-process runner, this process's ranks until ``distributed.global_step_inputs``).
      replicated: ``[m]`` int32, the replicated arrays (DP contexts).
      layouts: the ``packing.PackLayout`` of ``per_rank`` (one leading axis) and of
        ``replicated`` (none); static, part of the ``StepKey``.
      capacity: token rows of every rank (``input_ids``' second dimension).
    """

    per_rank: Any  # [rows, n] int32 (numpy on the host, a sharded array after ``put``)
    replicated: Any  # [m] int32
    layouts: tuple[packing.PackLayout, packing.PackLayout]  # (per_rank, replicated); static
    capacity: int  # token rows of every rank


def pack_step_inputs(
    per_rank: plan_arrays.PerRankInputs, replicated: plan_arrays.ReplicatedInputs
) -> StepInputs:
    """Packs a host plan's arrays for the step (see ``make_step`` for their fields).

    Args:
      per_rank: host arrays ``[rows, ...]`` stacked over DP ranks (``StepPlan.per_rank``).
      replicated: host arrays every rank shares (``StepPlan.replicated``).

    Returns:
      The ``StepInputs`` (numpy buffers, not yet on the devices).

    Raises:
      ValueError: a leaf that is neither bool nor 32-bit (``packing.pack`` names it), or
        per-rank leaves with different row counts.
    """
    per_rank_words, per_rank_layout = packing.pack(per_rank, lead_axes=1)
    replicated_words, replicated_layout = packing.pack(replicated)
    return StepInputs(
        per_rank=per_rank_words,
        replicated=replicated_words,
        layouts=(per_rank_layout, replicated_layout),
        capacity=int(per_rank.input_ids.shape[1]),
    )


SINGLE_DEVICE_MERGE_MAX_ROWS = 1024
"""Micro-batch rows up to which a one-device TBO step lets XLA merge A's and B's matmuls and
runs the row-wise operations once over both micro-batches (``_run_tbo``)."""
SINGLE_DEVICE_DOT_MERGER_MB = 1 << 20
"""``xla_gpu_dot_merger_threshold_mb`` of a small TBO step on one device: merge at any size."""
GPU_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
"""``xla_gpu_enable_command_buffer`` of every GPU step: CUDA graphs take the loops in too.

XLA:GPU records runs of kernels into CUDA graphs (command buffers), but by default a
``while`` loop (the attention's block and chunk loops) stays outside: each iteration reads its
condition back to the host, which splits the step into one graph per stretch between loops
and stalls the GPU at every read. With ``WHILE`` and ``CONDITIONAL`` the loops become
conditional graph nodes and the whole step is one graph, which made both steps faster on one
H200 (docs/benchmarks/, "TBO step cost on one H200", fused weights and one CUDA graph per
step, "While loops"). The other names are XLA's defaults (they must be listed: the option is
a list). On multi-GPU meshes the collectives stay outside the graphs (``COLLECTIVES`` is not
listed): a step runs as a few graphs split at the collectives (docs/benchmarks/, "Two
H200s", TBO step and overlap at dp=2).
"""


def step_compiler_options(mesh: jax.sharding.Mesh, child_capacity: int | None) -> dict | None:
    """XLA options a step of ``mesh`` compiles with (None: XLA's defaults).

    Every GPU step records its loops into CUDA graphs (``GPU_COMMAND_BUFFER``). A TBO step
    on a multi-GPU mesh also takes ``xla_options.tbo_compiler_options()``: micro-batch
    A's and B's matmuls and collectives must stay apart so that one's communication can hide
    under the other's compute. On one GPU there is no communication to hide. Keeping the
    matmuls apart then makes each micro-batch read every weight, which is most of a decode
    step. So small micro-batches (at most ``SINGLE_DEVICE_MERGE_MAX_ROWS`` rows: weight-
    bandwidth bound) let the dot merger loose (XLA's default stops at 32 MB, below an expert
    weight): A's and B's matmuls over one weight become one matmul that reads it once (the
    routed experts are one joint call there anyway: ``_run_tbo``'s lockstep). Large
    ones (compute bound) turn the dot merger off: merging them reads the weights once but
    concatenates both micro-batches' activations first, which costs more traffic
    (docs/benchmarks/, "TBO step cost on one GPU", and the router gates in "one-device TBO in
    lockstep"). The rows of the two micro-batches stay separate either way, so the numbers are
    the same.

    Args:
      mesh: the step's mesh.
      child_capacity: TBO child rows, or None for a plain step.

    Returns:
      The options dict, or None on a non-GPU mesh.
    """
    if mesh_lib.mesh_platform(mesh) not in ("gpu", "cuda"):
        return None
    options = {"xla_gpu_enable_command_buffer": GPU_COMMAND_BUFFER}
    if child_capacity is None:
        return options
    if mesh.devices.size > 1:
        return options | xla_options.tbo_compiler_options()
    merges = child_capacity <= SINGLE_DEVICE_MERGE_MAX_ROWS
    options["xla_gpu_dot_merger_threshold_mb"] = SINGLE_DEVICE_DOT_MERGER_MB if merges else 0
    return options


@dataclasses.dataclass(frozen=True)
class StepKey:
    """What selects one compiled program (every field is static under jit)."""

    capacity: int  # token rows per DP rank (the bucket)
    # Of the packed per_rank / replicated buffers: tree structure (attention kind, TBO fields,
    # the DP contexts' static padding mode and buffer lengths), every leaf's shape and dtype.
    layouts: tuple[packing.PackLayout, packing.PackLayout]
    mode: forward_mode_lib.ForwardMode  # the global mode (strategy layout)
    child_capacity: int | None  # TBO child rows; None: no TBO
    dispatchers: ep_dispatchers.Dispatchers | None  # EP dispatcher per micro-batch
    sampler: step_io.SamplerKey | None = None  # token ids instead of logits; None: logits


_STEP_IDS = itertools.count()


def program_name(key: StepKey) -> str:
    """The jitted step's name for ``key`` (jit names the program ``jit_<name>``).

    ``model_step_<capacity>``, then ``_tbo<child_capacity>_<mode>`` for a TBO step (the mode
    of its operation strategy; a plain step has one) and ``_tokens`` for a step that samples
    on the devices: the same for equal keys of any runner.
    """
    name = f"model_step_{key.capacity}"
    if key.child_capacity is not None:
        name += f"_tbo{key.child_capacity}_{key.mode.name.lower()}"
    return name + ("_tokens" if key.sampler is not None else "")


class Step:
    """The model step, one jitted program per ``StepKey``, each traced at most once.

    TBO programs compile with ``step_compiler_options`` (on a multi-GPU mesh XLA:GPU would
    otherwise merge the micro-batches' matmuls and collectives back together).
    """

    def __init__(self, sharded_step, mesh: jax.sharding.Mesh, table):
        """Args: sharded_step: ``_sharded_step`` bound to the model; mesh: its mesh; table:
        the ``ep_dispatchers.DispatcherTable`` of this step's EP dispatchers."""
        self._sharded_step = sharded_step
        self._mesh = mesh
        self._jitted: dict[StepKey, Any] = {}
        self.dispatchers = table

    def key(
        self, inputs: StepInputs, *, mode, child_capacity, dispatchers, sampler=None
    ) -> StepKey:
        """The compile key of a step's (packed) arguments."""
        return StepKey(
            capacity=inputs.capacity,
            layouts=inputs.layouts,
            mode=forward_mode_lib.ForwardMode(mode),
            child_capacity=child_capacity,
            dispatchers=dispatchers,
            sampler=sampler,
        )

    def jitted(self, key: StepKey):
        """The jitted ``(params, kv_cache, per_rank_words, replicated_words, prev_tokens=None)``
        of ``key``.

        The two buffers are ``StepInputs.per_rank`` / ``.replicated`` of ``key.layouts``;
        ``prev_tokens`` is the previous step's ``[dp, rows]`` token output (plans with a
        ``token_source``).
        """
        if key not in self._jitted:
            self._jitted[key] = self._build(key)
        return self._jitted[key]

    def _build(self, key: StepKey):
        bound = functools.partial(self._sharded_step, key=key)

        def model_step(params, kv_cache, per_rank_words, replicated_words, prev_tokens=None):
            return bound(params, kv_cache, per_rank_words, replicated_words, prev_tokens)

        # chex counts traces per name + source + call stack: a unique name gives every
        # (Step, key) its own count, so the guard reads "this key traced once". The jitted
        # function is then named after its key (program_name): jit names the program after
        # it, so equal programs of different runners share a name (the persistent
        # compilation cache serves them all) and a runner's programs of different modes,
        # buckets or TBO have their own (a profile's module names its program's HLO dump).
        model_step.__name__ = f"model_step_{next(_STEP_IDS)}"
        guarded = chex.assert_max_traces(model_step, n=1)
        guarded.__name__ = guarded.__qualname__ = program_name(key)
        options = step_compiler_options(self._mesh, key.child_capacity)
        everywhere = _named(self._mesh, P())
        out_shardings = (  # the shard_map's out_specs on the mesh (_sharded_step)
            _named(self._mesh, P(mesh_lib.DP_AXIS)),  # logits (or tokens, finite, logprobs)
            kv_cache_shardings(self._mesh),  # the pools: as the runner created them
            everywhere,  # overflow
            everywhere,  # peak_load
        )
        return jax.jit(
            guarded, donate_argnames=("kv_cache",), compiler_options=options,
            out_shardings=out_shardings,
        )  # fmt: skip

    def put(self, inputs: StepInputs) -> StepInputs:
        """Moves packed host buffers onto the mesh: two host->device transfers.

        Args:
          inputs: from ``pack_step_inputs`` with every DP rank's row (single process).

        Returns:
          The same inputs with ``per_rank`` sharded over ``"dp"`` and ``replicated`` on
          every device.
        """
        per_rank, replicated = jax.device_put(
            (inputs.per_rank, inputs.replicated),
            (
                jax.sharding.NamedSharding(self._mesh, P(mesh_lib.DP_AXIS)),
                jax.sharding.NamedSharding(self._mesh, P()),
            ),
        )
        return dataclasses.replace(inputs, per_rank=per_rank, replicated=replicated)

    def __call__(
        self, params, kv_cache, inputs: StepInputs, *, mode, child_capacity, dispatchers,
        sampler=None, prev_tokens=None,
    ):  # fmt: skip
        """Runs the step (see ``make_step``) on packed inputs (``pack_step_inputs``)."""
        key = self.key(
            inputs, mode=mode, child_capacity=child_capacity, dispatchers=dispatchers,
            sampler=sampler,
        )  # fmt: skip
        args = (params, kv_cache, inputs.per_rank, inputs.replicated)
        if prev_tokens is not None:
            args += (prev_tokens,)
        return self.jitted(key)(*args)

    @property
    def num_keys(self) -> int:
        """Compile keys seen so far (each traced exactly once)."""
        return len(self._jitted)

    def compile_count(self) -> int:
        """Programs compiled so far over every key."""
        return sum(jitted._cache_size() for jitted in self._jitted.values())
