"""The dense jnp reference agrees with the independent float64 reference."""

import jax
import numpy as np

from jtbo.attention import kv_cache, metadata, reference, tiling
from tests.attention import scenarios


def test_dense_reference_matches_float64_extend_and_verify():
    for custom in (False, True):
        lens = [2, 2, 2] if custom else [4, 1, 6]
        sc = scenarios.make(
            np.random.default_rng(int(custom)), [3, 0, 7], lens, token_capacity=12,
            custom_mask=custom, q_heads=6, kv_heads=3,
        )  # fmt: skip
        cap = (metadata.verify_capacity(6, 2, 32) if custom
               else metadata.extend_capacity(12, 3, 32, query_tile=4))  # fmt: skip
        md = tiling.build_metadata(
            cap, req=sc.req_pool_indices, q_start=np.cumsum(lens) - lens, q_len=lens,
            q_pos=sc.prefix_lens, kv_len=sc.prefix_lens + lens, out_cache_loc=sc.out_cache_loc,
            num_tokens=sc.num_tokens, mask_rows=sc.mask_rows,
        )  # fmt: skip
        loc = np.zeros((12,), np.int32)
        loc[: sc.num_tokens] = sc.out_cache_loc
        cache = kv_cache.write_kv(sc.cache, 1, loc, sc.k, sc.v)
        out = jax.jit(reference.attend_reference, static_argnames="scaling")(
            sc.q, cache, 1, md, scaling=8**-0.5
        )
        np.testing.assert_allclose(np.asarray(out, np.float64), sc.expected, atol=2e-5)
