"""Probe: FP8 experts' row quantization from the rows as their dtype holds them
(``fp8_blocks.quantize_rows``: an optimization barrier first) against the same quantization
without the barrier (XLA may then quantize a layer's unrounded float32 output), side by side
in one process: a stack of FP8 layers (``layer_stack_probe.stack``), ``"auto"``. Prints ms per
layer of each and whether the stacks' outputs are bit-equal; a markdown table last.

``PYTHONPATH=.:tools python tools/excess_precision_probe.py [--tokens 64,256,4096]
[--layers 4]`` (a GPU)
"""

import layer_stack_probe
import numpy as np

from jtbo.bench import device_rates
from jtbo.kernels import fp8_blocks


def _unguarded(x, group):
    return fp8_blocks.quantize_blocks(x, (1, group))


def main() -> None:
    args, shapes, copy_gbs = layer_stack_probe.setup(__doc__, dtypes=False)
    layer_weights = layer_stack_probe.layer_weights_of(shapes, args.layers, "fp8")
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        call_args = layer_stack_probe.stack_args(shapes, tokens, layer_weights)
        unguarded = ((fp8_blocks, "quantize_rows", _unguarded),)
        old, old_out = layer_stack_probe.compiled(layer_stack_probe.stack, call_args, unguarded)
        new, new_out = layer_stack_probe.compiled(layer_stack_probe.stack, call_args)
        cases = [(old, call_args), (new, call_args)]
        seconds = device_rates.time_fns_interleaved(cases, warmup=2, iters=10, reps=7)
        gbytes = layer_stack_probe.weight_gb(shapes, call_args[1], "fp8")
        per_layer = [s / args.layers for s in seconds]
        timed = layer_stack_probe.per_layer_cells(per_layer, gbytes, copy_gbs, digits=4)
        diff = np.abs(old_out - new_out).max() / np.abs(new_out).max()
        line = (
            f"| {tokens} | {' | '.join(timed)} | {seconds[0] / seconds[1]:.3f} "
            f"| {np.array_equal(old_out, new_out)} ({diff:.1e}) |"
        )
        rows.append(line)
        print(line, flush=True)
    layer_stack_probe.print_table(
        "| tokens | unguarded ms per layer (of copy) | quantize_rows ms per layer (of copy) "
        "| unguarded / guarded | bit-equal (max difference over max) |",
        rows,
    )


if __name__ == "__main__":
    main()
