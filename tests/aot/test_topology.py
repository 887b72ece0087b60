"""An 8xH200 program compiles on the CPU and shows GPU async collectives."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtbo import aot


def _gather_matmul_scatter(activations, weight):
    gathered = jax.lax.all_gather(activations, "x", tiled=True)
    return jax.lax.psum_scatter(gathered @ weight, "x", tiled=True)


def test_h200_mesh_compiles_gpu_collectives():
    mesh = aot.gpu_mesh((8,), ("x",))
    step = jax.jit(
        jax.shard_map(
            _gather_matmul_scatter,
            mesh=mesh,
            in_specs=(P("x"), P()),  # activations: rows over x; weight: replicated
            out_specs=P("x"),
            check_vma=False,
        )
    )
    activations = jax.ShapeDtypeStruct(
        (8 * 64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x"))
    )
    weight = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    text = step.lower(activations, weight).compile().as_text()
    assert "all-gather" in text and "reduce-scatter" in text
    assert "cublas" in text or "gemm" in text  # compiled for the GPU, not the CPU


def test_target_text_carries_h200_figures():
    text = aot.target_config_text()
    assert "core_count: 132" in text and "NVIDIA H200" in text and "major: 9" in text
