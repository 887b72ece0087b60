"""Probe: the capacity-slot routing chain of ``experts_capacity`` (its Mosaic path: ranks,
slot tokens, counts, tile table, gather sources, combine rows) against the same outputs from a
stable ``argsort``, at Qwen3-30B-A3B's routing (E=128, k=8), block_m 128; timed in turns, then
each chain's kernels from a trace.

``PYTHONPATH=. python tools/routing_probe.py 64,256,4096,16384`` (a GPU; tokens as the argument)
"""

import functools
import sys

import jax.numpy as jnp
import numpy as np

from jtbo.bench import device_rates, kernel_time, trace_calls
from jtbo.bench import grouped_gemm as bg
from jtbo.kernels import grouped_gemm_mosaic as gm
from jtbo.kernels import slot_rows, tile_table
from jtbo.models import experts

E, K, BM = 128, 8, 128


def current(x, ids, capacity, num_tiles):
    position = experts.slot_positions(ids, E)
    valid = (ids >= 0) & (ids < E) & (position < capacity)
    expert = jnp.where(valid, ids, E)
    slots = slot_rows.SlotRows(x, experts._slot_tokens(expert, position, E, capacity))
    counts = jnp.bincount(expert.reshape(-1), length=E + 1)[:E].astype(jnp.int32)
    tile_expert, slot_of_row, row_of_slot = gm.tile_rows(counts, capacity, BM, num_tiles)
    _, source = slot_rows.flat_slot_source(slots, slot_of_row)
    source = gm.unfused(source)
    inside = valid
    flat = jnp.where(inside, expert * capacity + position, -1)
    rows, row = slot_rows.flat_slot_source(slot_rows.SlotRows(x, row_of_slot), flat)
    return tile_expert, source, row


def by_sort(x, ids, num_tiles):
    flat = ids.reshape(-1)
    n = flat.shape[0]
    key = jnp.where((flat >= 0) & (flat < E), flat, E)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=E + 1)[:E].astype(jnp.int32)
    start = jnp.cumsum(counts) - counts
    first_tile, end_tile = tile_table.tile_spans(counts, BM)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.searchsorted(end_tile, tile, side="right", method="compare_all")
    group = jnp.minimum(group, E - 1).astype(jnp.int32)
    live_tile = tile < end_tile[-1]
    j = (tile - first_tile[group])[:, None] * BM + jnp.arange(BM, dtype=jnp.int32)[None, :]
    live = live_tile[:, None] & (j < counts[group][:, None])
    sorted_index = jnp.clip(start[group][:, None] + j, 0, n - 1)
    pair = jnp.where(live, order[sorted_index], -1)
    source = jnp.where(pair >= 0, pair // K, -1).reshape(-1)
    tile_expert = jnp.where(live_tile, group, -1)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    keyc = jnp.minimum(key, E - 1)
    out_row = jnp.where(key < E, first_tile[keyc] * BM + rank - start[keyc], -1)
    return tile_expert, gm.unfused(source), out_row.reshape(ids.shape)


def main():
    jit = bg.jit_as_step
    shapes = bg.Shapes(2048, 768, E, K)
    for tokens in (int(t) for t in sys.argv[1].split(",")):
        ids_np, _ = bg.route(tokens, shapes, 0.0, tokens)
        ids = jnp.asarray(ids_np)
        x = jnp.ones((tokens, 2048), jnp.bfloat16)
        for capacity in (tokens * K // E * 4, tokens):
            num_tiles = tile_table.max_tiles(E, capacity, BM, tokens * K)
            f_cur = jit(functools.partial(current, capacity=capacity, num_tiles=num_tiles))
            f_sort = jit(functools.partial(by_sort, num_tiles=num_tiles))
            a, b = f_cur(x, ids), f_sort(x, ids)
            same = all(
                np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(a, b, strict=True)
            )
            t = device_rates.time_fns_interleaved(
                [(f_cur, (x, ids)), (f_sort, (x, ids))], warmup=2, iters=25, reps=5
            )
            print(
                f"T={tokens} C={capacity}: current {t[0] * 1e6:.1f} us, sort {t[1] * 1e6:.1f} us"
                f" (equal outputs: {same})",
                flush=True,
            )
            for name, f in (("current", f_cur), ("sort", f_sort)):
                ks = trace_calls.trace_kernels(functools.partial(f, x, ids), 10)
                print(f"  {name}: {kernel_time.kernels_per_call(ks, 10, top=12)}", flush=True)


if __name__ == "__main__":
    main()
