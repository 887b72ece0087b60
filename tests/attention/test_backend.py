"""NativeAttnBackend: per-rank metadata stacked along dp and run under shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jtbo.attention import backend, metadata, native
from jtbo.collectives import mesh as mesh_lib
from jtbo.kernels import impls
from tests.attention import scenarios

CONTEXT = 32
CAPACITY = metadata.extend_capacity(16, 3, CONTEXT, query_tile=4)
BACKEND = backend.NativeAttnBackend(CAPACITY, native.NativeAttentionConfig(kv_block=8))


def _rank_forward(q, k, v, md, cache):
    """One DP rank's attention over its local shard (leading dp axis of size 1 dropped)."""
    q, k, v, md, cache = jax.tree.map(lambda x: x[0], (q, k, v, md, cache))
    out, cache = BACKEND.forward(q, k, v, 1, md, cache)
    return jax.tree.map(lambda x: x[None], (out, cache))


@pytest.mark.skipif(
    jax.device_count() < 2, reason=f"needs 2 devices, this host has {jax.device_count()}"
)
def test_dp_ranks_attend_their_own_requests_under_shard_map():
    rank_lens = [([2, 0, 5], [3, 6, 2]), ([9], [4])]  # different batches per rank
    scs = [
        scenarios.make(np.random.default_rng(r), p, n, token_capacity=16)
        for r, (p, n) in enumerate(rank_lens)
    ]
    mds = [BACKEND.init_forward_metadata(scenarios.extend_batch(sc)) for sc in scs]
    stack = lambda *xs: np.stack([np.asarray(x) for x in xs])  # noqa: E731
    md = jax.tree.map(stack, *mds)
    cache = jax.tree.map(stack, *[sc.cache for sc in scs])
    q, k, v = (stack(*[getattr(sc, name) for sc in scs]) for name in ("q", "k", "v"))
    mesh = jax.make_mesh(
        (2,), (mesh_lib.DP_AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:2],
    )  # fmt: skip
    dp = P(mesh_lib.DP_AXIS)
    in_specs = (
        dp,  # q [dp, tokens, q_heads, d]
        dp,  # k [dp, tokens, kv_heads, d]
        dp,  # v [dp, tokens, kv_heads, d]
        dp,  # metadata, every leaf [dp, ...]
        dp,  # kv cache, every leaf [dp, ...]
    )
    step = jax.jit(
        jax.shard_map(_rank_forward, mesh=mesh, in_specs=in_specs, out_specs=dp, check_vma=False)
    )
    out, _ = step(q, k, v, md, cache)
    for rank, sc in enumerate(scs):
        np.testing.assert_allclose(np.asarray(out[rank], np.float64), sc.expected, atol=2e-5)


def test_forward_rejects_metadata_of_another_capacity():
    sc = scenarios.make(np.random.default_rng(3), [1], [2], token_capacity=16)
    other = metadata.extend_capacity(16, 3, CONTEXT, query_tile=8)
    md = backend.NativeAttnBackend(other).init_forward_metadata(scenarios.extend_batch(sc))
    with pytest.raises(ValueError, match="capacity"):
        BACKEND.forward(sc.q, sc.k, sc.v, 1, md, sc.cache)


def test_backend_names_and_the_pallas_backend_checks_its_capacity():
    assert backend.backend_class("native") is backend.NativeAttnBackend
    assert backend.backend_class("pallas") is backend.PallasAttnBackend
    assert backend.backend_class("triton") is backend.TritonAttnBackend
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        backend.backend_class("flash")
    pallas = backend.PallasAttnBackend(metadata.decode_capacity(4, 32))
    other = metadata.empty_metadata(metadata.decode_capacity(2, 32))
    x = jnp.zeros((4, 2, 16), jnp.float32)
    cache = scenarios.zero_cache(1, 4, 2, 16, 2, 32)
    with pytest.raises(ValueError, match="metadata capacity"):
        pallas.forward(x, x, x, 0, other, cache)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU backend")
@pytest.mark.parametrize(
    "capacity", [metadata.decode_capacity(4, 32), metadata.extend_capacity(4, 2, 32, query_tile=2)]
)
def test_the_triton_backend_raises_off_gpus(capacity):
    # Both of its kernels (paged for decode, extend for extend) name the impl and why.
    triton = backend.TritonAttnBackend(capacity)
    x = jnp.ones((4, 2, 16), jnp.float32)
    cache = scenarios.zero_cache(1, 8, 2, 16, 2, 32)
    with pytest.raises(impls.KernelUnavailableError, match="impl='triton'.*GPUs only"):
        triton.forward(x, x, x, 0, triton.empty_metadata(), cache)
