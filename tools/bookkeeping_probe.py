"""Probe: the expert layer's routing bookkeeping before and after the tile table's group
lookup became a row reduction and the slot tokens one scatter, side by side in one process;
the layer as the model calls it (``experts_capacity``, capacity = T, ``"auto"``) in a stack
of layers (``layer_stack_probe.stack``), bf16 and FP8 experts at decode sizes. The old code is
this file's copy of the two functions, patched in while the old stack traces. Prints ms per
layer, weight bytes over the copy ceiling, kernels per layer, and whether the outputs are
bit-equal; a markdown table last.

``PYTHONPATH=.:tools python tools/bookkeeping_probe.py [--tokens 64,128,256]`` (a GPU)
"""

import functools

import jax.numpy as jnp
import layer_stack_probe
import numpy as np

from jtbo.bench import device_rates, kernel_time, trace_calls
from jtbo.kernels import slot_rows, tile_table
from jtbo.models import experts


def old_row_tiles(group_start, group_size, block_m, num_tiles):
    first, ends = tile_table.tile_spans(group_size, block_m)
    index = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.searchsorted(ends, index, side="right", method="compare_all")
    group = jnp.minimum(group, group_size.shape[0] - 1).astype(jnp.int32)
    live = index < ends[-1]
    start = group_start[group] + (index - first[group]) * block_m
    end = group_start[group] + group_size[group]
    table = [jnp.where(live, group, -1), jnp.where(live, start, 0), jnp.where(live, end, 0)]
    return jnp.stack(table).astype(jnp.int32)


def old_slot_tokens(expert, position, num_experts, capacity):
    slot = jnp.where(expert < num_experts, expert * capacity + position, -1).reshape(-1)
    pair = slot_rows.invert_slots(slot.astype(jnp.int32), num_experts * capacity)
    token = jnp.where(pair >= 0, pair // expert.shape[1], -1)
    return token.reshape(num_experts, capacity)


OLD_CODE = (
    (tile_table, "row_tiles", old_row_tiles),
    (experts, "_slot_tokens", old_slot_tokens),
)


def main() -> None:
    args, shapes, copy_gbs = layer_stack_probe.setup(__doc__, dtypes=False)
    rows = []
    for dtype in ("fp8", "bf16"):
        layer_weights = layer_stack_probe.layer_weights_of(shapes, args.layers, dtype)
        for tokens in map(int, args.tokens.split(",")):
            call_args = layer_stack_probe.stack_args(shapes, tokens, layer_weights)
            old, _ = layer_stack_probe.compiled(layer_stack_probe.stack, call_args, OLD_CODE)
            new, _ = layer_stack_probe.compiled(layer_stack_probe.stack, call_args)
            x, layer_ids, layer_routing, _ = call_args
            one_layer = (x, layer_ids[0], layer_routing[0], layer_weights[0])
            _, old_out = layer_stack_probe.compiled(layer_stack_probe.layer, one_layer, OLD_CODE)
            _, new_out = layer_stack_probe.compiled(layer_stack_probe.layer, one_layer)
            cases = [(old, call_args), (new, call_args)]
            seconds = device_rates.time_fns_interleaved(cases, warmup=2, iters=20, reps=9)
            per_layer = [s / args.layers for s in seconds]
            gbytes = layer_stack_probe.weight_gb(shapes, call_args[1], dtype)
            counts = []
            for fn in (old, new):
                ks = trace_calls.trace_kernels(functools.partial(fn, *call_args), 5)
                counts.append(f"{len(ks) / 5 / args.layers:.1f}")
                print(f"  {kernel_time.kernels_per_call(ks, 5 * args.layers, top=3)}", flush=True)
            timed = layer_stack_probe.per_layer_cells(per_layer, gbytes, copy_gbs, digits=4)
            line = (
                f"| {dtype} | {tokens} | {' | '.join(timed)} | {seconds[0] / seconds[1]:.3f} "
                f"| {' / '.join(counts)} | {np.array_equal(old_out, new_out)} |"
            )
            rows.append(line)
            print(line, flush=True)
    layer_stack_probe.print_table(
        "| experts | tokens | old ms per layer (of copy) | new ms per layer (of copy) "
        "| old / new | kernels per layer old / new | one layer bit-equal |",
        rows,
    )


if __name__ == "__main__":
    main()
