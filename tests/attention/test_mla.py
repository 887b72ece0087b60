"""MLA over the latent pool: both forms vs float64 references, absorbed == decompressed, and
the TBO backend's children (their metadata from split_batch) equal the parent."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtbo import split
from jtbo.attention import backend as backend_lib
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.attention import metadata, mla, mla_reference, native, paged, tbo_backend, tiling
from jtbo.kernels import impls
from tests.attention import scenarios

# The kernel on a GPU loads the latent row in parts RANK and ROPE, the decompressed key in
# parts NOPE and ROPE (32 + 16) and values of V (or RANK) columns: powers of two >= 16.
RANK, ROPE, NOPE, V, HEADS = 16, 16, 32, 16, 4
CONTEXT, SLOTS, LAYERS = 32, 96, 2
# The up-projection's scale: q_nope . k_nope has variance RANK * NOPE * W_SCALE**2 = 15.4,
# as with the 6 nope columns this file once used and a GPU passed with TF32 rounding.
W_SCALE = 0.4 * np.sqrt(6 / NOPE)
SCALE = 0.3
CONFIG = native.NativeAttentionConfig(kv_block=8, decode_kv_block=8)
_forward = jax.jit(mla.forward, static_argnames=("scaling", "absorbed", "config"))


@dataclasses.dataclass
class Case:
    """A batch over a latent pool and its float64 reference per sequence."""

    md: metadata.AttentionMetadata
    cache: kv_cache_lib.KVCache
    q_nope: np.ndarray  # [T, heads, nope]
    q_pe: np.ndarray  # [T, heads, rope]
    latent: np.ndarray  # [T, rank + rope]
    w_kv_b: np.ndarray  # [rank, heads, nope + v]
    expected: np.ndarray  # [T, heads, v] float64
    num_tokens: int


def _case(rng, prefix, new, capacity, token_capacity, tree=None) -> Case:
    """Random prefixes in the pool at shuffled slots, ``new`` tokens per sequence."""
    prefix, new = np.asarray(prefix), np.asarray(new)
    n, total = len(prefix), int(new.sum())
    slots = rng.permutation(np.arange(1, SLOTS))
    pool = rng.normal(size=(LAYERS, SLOTS, 1, RANK + ROPE)).astype(np.float32)
    table = np.zeros((8, CONTEXT), np.int32)
    reqs = rng.permutation(8)[:n]
    q_nope = rng.normal(size=(token_capacity, HEADS, NOPE)).astype(np.float32)
    q_pe = rng.normal(size=(token_capacity, HEADS, ROPE)).astype(np.float32)
    latent = rng.normal(size=(token_capacity, RANK + ROPE)).astype(np.float32)
    w = (W_SCALE * rng.normal(size=(RANK, HEADS, NOPE + V))).astype(np.float32)
    expected = np.zeros((token_capacity, HEADS, V))
    locs, starts, used, masks = [], np.cumsum(new) - new, 0, []
    for i in range(n):
        seq_slots = slots[used : used + prefix[i] + new[i]]
        used += prefix[i] + new[i]
        table[reqs[i], : len(seq_slots)] = seq_slots
        locs.append(seq_slots[prefix[i] :])
        rows = slice(starts[i], starts[i] + new[i])
        context = np.concatenate([pool[1, seq_slots[: prefix[i]], 0], latent[rows]])
        if tree is None:
            mask = np.arange(len(seq_slots))[None] <= prefix[i] + np.arange(new[i])[:, None]
        else:
            mask = np.concatenate([np.ones((new[i], prefix[i]), bool), tree], axis=1)
            masks.append(mask)
        expected[rows] = mla_reference.decompressed(
            q_nope[rows], q_pe[rows], context, w, mask, SCALE
        )
    md = tiling.build_metadata(
        capacity, req=reqs, q_start=starts, q_len=new, q_pos=prefix, kv_len=prefix + new,
        out_cache_loc=np.concatenate(locs), num_tokens=total, mask_rows=masks or None,
    )  # fmt: skip
    cache = kv_cache_lib.KVCache(k=jnp.asarray(pool), v=None, req_to_token=jnp.asarray(table))
    return Case(md, cache, q_nope, q_pe, latent, w, expected, total)


def _run(case: Case, absorbed: bool):
    return _forward(
        case.q_nope, case.q_pe, case.latent, case.w_kv_b, 1, case.md, case.cache,
        scaling=SCALE, absorbed=absorbed, config=CONFIG,
    )  # fmt: skip


def _extend_case(seed):
    capacity = metadata.extend_capacity(24, 4, CONTEXT, query_tile=4)
    return _case(np.random.default_rng(seed), [0, 5, 9], [6, 3, 7], capacity, 24)


def _fresh_extend_case(seed):
    capacity = metadata.extend_capacity(24, 4, CONTEXT, query_tile=4)
    return _case(np.random.default_rng(seed), [0, 0, 0], [6, 3, 7], capacity, 24)


def _decode_case(seed):
    capacity = metadata.decode_capacity(4, CONTEXT)
    return _case(np.random.default_rng(seed), [7, 1, 20], [1, 1, 1], capacity, 4)


def _verify_case(seed):
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    capacity = metadata.verify_capacity(3, 3, CONTEXT)
    return _case(np.random.default_rng(seed), [4, 11], [3, 3], capacity, 9, tree=tree)


@pytest.mark.parametrize("make", [_extend_case, _fresh_extend_case, _decode_case, _verify_case])
@pytest.mark.parametrize("absorbed", [False, True])
def test_both_forms_match_the_float64_reference(make, absorbed):
    case = make(3)
    out, cache = _run(case, absorbed)
    n = case.num_tokens
    np.testing.assert_allclose(
        np.asarray(out[:n], np.float64), case.expected[:n], atol=scenarios.f32_tolerance(3e-5)
    )
    assert not np.asarray(out[n:]).any()  # padded rows are zeros
    # The step's latent rows landed in layer 1's pool at out_cache_loc, layer 0 untouched.
    loc = np.asarray(case.md.out_cache_loc[:n])
    np.testing.assert_array_equal(np.asarray(cache.k[1, loc, 0]), case.latent[:n])
    np.testing.assert_array_equal(np.asarray(cache.k[0]), np.asarray(case.cache.k[0]))


@pytest.mark.parametrize("make", [_extend_case, _decode_case])
def test_absorbed_equals_decompressed_within_float32_rounding(make):
    case = make(11)
    absorbed, _ = _run(case, True)
    decompressed, _ = _run(case, False)
    scale = np.abs(case.expected).max()
    np.testing.assert_allclose(
        np.asarray(absorbed), np.asarray(decompressed), atol=scenarios.f32_tolerance(1e-5) * scale
    )


def test_float64_references_agree():
    rng = np.random.default_rng(0)
    q_nope, q_pe = rng.normal(size=(5, HEADS, NOPE)), rng.normal(size=(5, HEADS, ROPE))
    latent, w = rng.normal(size=(9, RANK + ROPE)), rng.normal(size=(RANK, HEADS, NOPE + V))
    mask = rng.random((5, 9)) < 0.6
    mask[0] = False  # a row that sees nothing gives zeros in both forms
    args = (q_nope, q_pe, latent, w, mask, SCALE)
    np.testing.assert_allclose(
        mla_reference.absorbed(*args), mla_reference.decompressed(*args), atol=1e-12
    )
    assert not mla_reference.absorbed(*args)[0].any()


def test_uses_absorbed_for_decode_and_verify_only():
    assert mla.uses_absorbed(metadata.decode_capacity(4, CONTEXT))
    assert mla.uses_absorbed(metadata.verify_capacity(3, 3, CONTEXT))
    assert not mla.uses_absorbed(metadata.extend_capacity(24, 4, CONTEXT))


def test_a_gqa_cache_is_refused():
    case = _decode_case(0)
    gqa = dataclasses.replace(case.cache, v=case.cache.k)
    with pytest.raises(ValueError, match="latent cache"):
        mla.write_latent(jnp.asarray(case.latent), 1, case.md, gqa)


def _tbo_mla(sc, tbo, md, ranges, rng):
    """MLA through the parent backend and through both children (latent threaded A -> B).

    Returns the children's merged output and child B's output over the pool *before* A's
    writes (what B would see if the latent were not threaded).
    """
    width = RANK + ROPE
    pool = rng.normal(size=(LAYERS, sc.cache.num_slots, 1, width)).astype(np.float32)
    initial = kv_cache_lib.KVCache(k=jnp.asarray(pool), v=None, req_to_token=sc.cache.req_to_token)
    t = sc.q.shape[0]
    inputs = [rng.normal(size=(t, *shape)).astype(np.float32)
              for shape in ((HEADS, NOPE), (HEADS, ROPE), (width,))]  # fmt: skip
    w = (W_SCALE * rng.normal(size=(RANK, HEADS, NOPE + V))).astype(np.float32)
    run = jax.jit(lambda b, *a: b.forward_mla(*a, scaling=SCALE), static_argnums=0)
    parent, parent_cache = run(tbo, *inputs, w, 1, md.primary, initial)
    merged, cache = np.zeros_like(np.asarray(parent)), initial
    for child, child_md, (start, end) in zip(tbo.children, md.children, ranges, strict=True):
        rows = [_pad_rows(x[start:end], child.capacity.token_capacity) for x in inputs]
        stale, _ = run(child, *rows, w, 1, child_md, initial)
        out, cache = run(child, *rows, w, 1, child_md, cache)
        merged[start:end] = np.asarray(out)[: end - start]
    np.testing.assert_allclose(
        merged,
        np.asarray(parent),
        atol=scenarios.f32_tolerance(1e-5),
        rtol=scenarios.f32_tolerance(1e-5),
    )
    np.testing.assert_array_equal(np.asarray(cache.k)[:, 1:], np.asarray(parent_cache.k)[:, 1:])
    return merged, np.asarray(stale)


def _pad_rows(x, rows):
    out = np.zeros((rows, *x.shape[1:]), x.dtype)
    out[: x.shape[0]] = x
    return out


def _tbo(capacity, child_capacity):
    return tbo_backend.TboAttnBackend.init_new(
        lambda c: backend_lib.NativeAttnBackend(c, CONFIG),
        capacity=capacity, child_capacity=child_capacity,
    )  # fmt: skip


def test_tbo_children_of_a_two_chunk_extend_equal_the_parent():
    sc = scenarios.make(np.random.default_rng(0), [2, 5], [3, 20], token_capacity=24)
    parent = scenarios.extend_batch(sc)
    index = split.compute_split_seq_index(split.ForwardMode.EXTEND, sc.num_tokens, [3, 20], None)
    children = split.split_batch(dataclasses.replace(parent, tbo_split_seq_index=index))
    tbo = _tbo(
        metadata.extend_capacity(24, 4, CONTEXT, 4),
        metadata.extend_capacity(split.child_capacity(24), 4, CONTEXT, 4),
    )
    md = tbo.init_forward_metadata(parent, children)
    starts = [int(c.tbo_parent_token_range[0]) for c in children]
    ranges = [(s, s + c.num_valid_tokens) for s, c in zip(starts, children, strict=True)]
    merged, stale = _tbo_mla(sc, tbo, md, ranges, np.random.default_rng(1))
    # B's rows continue A's part of the same prompt: they must read A's latent rows.
    b_start, b_end = ranges[1]
    assert not np.allclose(stale[: b_end - b_start], merged[b_start:b_end], atol=1e-3)


def test_tbo_verify_children_equal_the_parent():
    draft = 2
    sc = scenarios.make(
        np.random.default_rng(3), [5, 0, 12], [draft] * 3, token_capacity=8, custom_mask=True
    )
    padded = scenarios.verify_batch(sc, draft, padded_seqs=1)  # a bucket of 4 seqs
    tbo = _tbo(
        metadata.verify_capacity(4, draft, CONTEXT), metadata.verify_capacity(2, draft, CONTEXT)
    )
    children = split.split_batch(dataclasses.replace(padded, tbo_split_seq_index=2))
    md = tbo.init_forward_metadata(padded, children)
    _tbo_mla(sc, tbo, md, [(0, 4), (4, 8)], np.random.default_rng(4))


KERNEL_BACKENDS = {"pallas": backend_lib.PallasAttnBackend, "triton": backend_lib.TritonAttnBackend}


@pytest.mark.parametrize("name", scenarios.KERNEL_IMPLS)
@pytest.mark.parametrize("make", [_decode_case, _verify_case, _extend_case, _fresh_extend_case])
def test_kernel_backends_match_the_float64_reference(make, name):
    # Decode and verify: the paged kernel over the latent pool (interpreter on the CPU), the
    # values being the latent rows' first RANK columns; extend with prefixes: the native
    # decompressed form; fresh prompts: the kernel over the step's up-projected rows.
    case = make(5)
    backend = KERNEL_BACKENDS[name](case.md.capacity)
    step = jax.jit(functools.partial(backend.forward_mla, scaling=SCALE), static_argnums=4)
    out, cache = step(case.q_nope, case.q_pe, case.latent, case.w_kv_b, 1, case.md, case.cache)
    n = case.num_tokens
    np.testing.assert_allclose(
        np.asarray(out[:n], np.float64), case.expected[:n], atol=scenarios.f32_tolerance(3e-5)
    )
    assert not np.asarray(out[n:]).any()
    loc = np.asarray(case.md.out_cache_loc[:n])
    np.testing.assert_array_equal(np.asarray(cache.k[1, loc, 0]), case.latent[:n])


@pytest.mark.parametrize("make", [_decode_case, _verify_case])
def test_latent_kernel_equals_the_native_latent_attention(make):
    case = make(8)
    cache = mla.write_latent(jnp.asarray(case.latent), 1, case.md, case.cache)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(case.q_nope.shape[0], HEADS, RANK + ROPE)), jnp.float32)
    want = paged.paged_attention(q, cache, 1, case.md, scaling=SCALE, value_width=RANK, impl="xla")
    for impl in scenarios.KERNEL_IMPLS:
        got = paged.paged_attention(
            q, cache, 1, case.md, scaling=SCALE, value_width=RANK, impl=impl
        )
        chex.assert_trees_all_close(
            got, want, atol=scenarios.f32_tolerance(1e-5), rtol=scenarios.f32_tolerance(1e-5)
        )
    if jax.default_backend() == "cpu":
        with pytest.raises(impls.KernelUnavailableError, match="impl='triton' is unavailable"):
            paged.paged_attention(
                q, cache, 1, case.md, scaling=SCALE, value_width=RANK, impl="triton"
            )


def test_fresh_prompts_take_the_step_rows_and_both_paths_agree():
    # Without prefixes the decompressed form attends the step's own rows, up-projected once;
    # with a prefix it up-projects the pool blocks. On a fresh batch both give the reference.
    fresh, prefixed = _fresh_extend_case(13), _extend_case(13)
    reqs = fresh.cache.req_to_token.shape[0]
    assert bool(mla.has_no_prefix(fresh.md, reqs)) and not mla.has_no_prefix(prefixed.md, reqs)
    cache = mla.write_latent(jnp.asarray(fresh.latent), 1, fresh.md, fresh.cache)
    q = jnp.concatenate([fresh.q_nope, fresh.q_pe], axis=-1)
    view = mla.decompressed_view(jnp.asarray(fresh.w_kv_b), NOPE)
    rows = mla.step_rows_cache(jnp.asarray(fresh.latent), view, fresh.md, cache)
    from_rows = native.attend(q, rows, 0, fresh.md, scaling=SCALE, config=CONFIG)
    from_pool = native.attend(q, cache, 1, fresh.md, scaling=SCALE, config=CONFIG, view=view)
    # The kernel over the rows: keys of NOPE + ROPE columns (cut into power-of-two parts),
    # values of V columns, one KV head per query head.
    from_kernel = paged.paged_attention(q, rows, 0, fresh.md, scaling=SCALE, impl="pallas")
    n = fresh.num_tokens
    for other in (from_pool, from_kernel):
        chex.assert_trees_all_close(
            from_rows[:n],
            other[:n],
            atol=scenarios.f32_tolerance(1e-5),
            rtol=scenarios.f32_tolerance(1e-5),
        )
    np.testing.assert_allclose(
        np.asarray(from_rows[:n], np.float64),
        fresh.expected[:n],
        atol=scenarios.f32_tolerance(3e-5),
    )
