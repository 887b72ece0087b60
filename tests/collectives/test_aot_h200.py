"""The collectives and EP dispatch/combine compile for 8xH200 on the CPU and show GPU ops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtbo import aot
from jtbo.collectives import context as context_lib
from jtbo.collectives import ep_config, ep_dispatch, gather, padding, scatter
from jtbo.collectives import mesh as mesh_lib

pytestmark = pytest.mark.skipif(not aot.aot_available(), reason="needs the `aot` extra")

HIDDEN = 256
CAPACITY = 64


def spec(mesh, shape, dtype, partition):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, partition))


def compile_text(mesh, fn, in_specs, out_specs, args):
    step = jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )
    return step.lower(*args).compile().as_text()


def _dp_round_trip(context, local, weight):
    full_max = gather.dp_gather_replicate(local, context, memcpy_impl="xla")
    return scatter.dp_reduce_scatter_tensor(full_max @ weight, context, memcpy_impl="xla")


@pytest.mark.parametrize("mode", padding.DpPaddingMode, ids=lambda m: m.name)
def test_dp_collectives_compile_for_h200(mode):
    dp_size, attn_tp_size = 4, 2
    mesh = aot.gpu_mesh((dp_size, attn_tp_size), mesh_lib.TP_AXES)
    counts = [CAPACITY, 0, 17, 3]
    context = context_lib.create_dp_context(
        counts, mode, CAPACITY, attn_tp_size, dp_size * CAPACITY
    )
    context_spec = jax.tree.map(
        lambda x: spec(mesh, x.shape, x.dtype, P()), context
    )  # the counts, replicated
    text = compile_text(
        mesh,
        _dp_round_trip,
        (P(), P(mesh_lib.TP_AXES), P()),  # context; local rows per device; weight
        P(mesh_lib.TP_AXES),
        (
            context_spec,
            spec(mesh, (8 * CAPACITY, HIDDEN), jnp.bfloat16, P(mesh_lib.TP_AXES)),
            spec(mesh, (HIDDEN, HIDDEN), jnp.bfloat16, P()),
        ),
    )
    if mode.is_max_len():
        assert "reduce-scatter" in text and "all-gather" in text
    else:
        assert "all-reduce" in text
    assert "gemm" in text or "cublas" in text  # compiled for the GPU


def _two_micro_batches(dispatcher, hidden, ids, weights, other, weight, expert_weight):
    # Micro-batch A's dispatch/combine are in flight while micro-batch B's matmuls run.
    in_flight = ep_dispatch.dispatch_a(dispatcher, hidden, ids, weights, hidden.shape[0])
    other = other @ weight
    slots, state = ep_dispatch.dispatch_b(dispatcher, in_flight)
    expert_inputs = slots.materialize()
    expert_outputs = jnp.einsum("esh,ehf->esf", expert_inputs, expert_weight)
    returning = ep_dispatch.combine_a(dispatcher, expert_outputs, state)
    other = other @ weight
    return ep_dispatch.combine_b(dispatcher, returning), other, state.overflow


@functools.cache
def ep_text(exchange):
    mesh = aot.gpu_mesh((4, 2), mesh_lib.TP_AXES)
    tokens, top_k, num_experts = 128, 2, 16
    dispatcher = ep_config.create_ep_dispatcher(
        mesh, num_experts=num_experts, num_tokens=tokens, top_k=top_k, exchange=exchange
    )
    shard = P(mesh_lib.TP_AXES)
    local = dispatcher.num_local_experts
    args = (
        spec(mesh, (8 * tokens, HIDDEN), jnp.bfloat16, shard),
        spec(mesh, (8 * tokens, top_k), jnp.int32, shard),
        spec(mesh, (8 * tokens, top_k), jnp.float32, shard),
        spec(mesh, (8 * 512, 1024), jnp.bfloat16, shard),
        spec(mesh, (1024, 1024), jnp.bfloat16, P()),
        spec(mesh, (8 * local, HIDDEN, HIDDEN), jnp.bfloat16, shard),
    )
    return compile_text(
        mesh,
        functools.partial(_two_micro_batches, dispatcher),
        # hidden, topk ids, topk weights, other micro-batch, its weight, expert weights
        (shard, shard, shard, shard, P(), shard),
        (shard, shard, shard),
        args,
    )


def test_dense_ep_compiles_to_async_all_to_all():
    text = ep_text("dense")
    assert "all-to-all-start" in text and "all-to-all-done" in text
    assert "ragged-all-to-all" not in text
    # The split halves leave room for overlap: some exchange has a GEMM between start and done.
    entry = text[text.index("ENTRY") :].splitlines()
    overlapped = False
    for i, line in enumerate(entry):
        if "all-to-all-start(" in line:
            name = line.split("=")[0].strip()
            done = next(j for j in range(i, len(entry)) if f"all-to-all-done({name})" in entry[j])
            overlapped |= any("gemm" in entry[j] for j in range(i, done))
    assert overlapped


def test_ragged_ep_compiles_to_ragged_all_to_all():
    text = ep_text("ragged")
    assert "ragged-all-to-all" in text


def test_aot_context_spec_is_replicated():
    # The counts travel as a tiny replicated int32 array; everything else is static.
    context = context_lib.create_dp_context([1, 2], padding.DpPaddingMode.SUM_LEN, 8)
    leaves = jax.tree.leaves(context)
    assert len(leaves) == 1 and np.asarray(leaves[0]).dtype == np.int32
