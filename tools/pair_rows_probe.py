"""Probe: the expert layer with its rows found by the kernels from the (token, choice) pairs
(``grouped_gemm.grouped_ffn_pairs``, ``experts_capacity``'s path up to ``PAIRS_MAX`` pairs)
against the capacity-slot layout built before the kernels (``PAIRS_MAX`` 0), side by side in
one process, in a stack of layers (``layer_stack_probe.stack``, ``"auto"``). Prints ms per
layer of each (weight bytes per second over the copy ceiling), their ratio and whether the
stacks' outputs are bit-equal; the stack's kernels per layer of each; a markdown table last.

``PYTHONPATH=.:tools python tools/pair_rows_probe.py [--tokens 64,128,256,512]
[--dtypes fp8,bf16] [--layers 8]`` (a GPU)
"""

import functools

import layer_stack_probe
import numpy as np

from jtbo.bench import device_rates, kernel_time, trace_calls
from jtbo.kernels import grouped_gemm

CASES = {
    "slots": ((grouped_gemm, "PAIRS_MAX", 0),),
    "pairs": ((grouped_gemm, "PAIRS_MAX", 1 << 20),),
}


def main() -> None:
    args, shapes, copy_gbs = layer_stack_probe.setup(__doc__)
    rows = []
    for dtype in args.dtypes.split(","):
        layer_weights = layer_stack_probe.layer_weights_of(shapes, args.layers, dtype)
        for tokens in map(int, args.tokens.split(",")):
            call_args = layer_stack_probe.stack_args(shapes, tokens, layer_weights)
            built = [
                layer_stack_probe.compiled(layer_stack_probe.stack, call_args, patches)
                for patches in CASES.values()
            ]
            cases = [(fn, call_args) for fn, _ in built]
            seconds = device_rates.time_fns_interleaved(cases, warmup=2, iters=10, reps=7)
            gbytes = layer_stack_probe.weight_gb(shapes, call_args[1], dtype)
            per_layer = [s / args.layers for s in seconds]
            timed = layer_stack_probe.per_layer_cells(per_layer, gbytes, copy_gbs, digits=4)
            (_, slots_out), (_, pairs_out) = built
            line = (
                f"| {dtype} | {tokens} | {' | '.join(timed)} | {seconds[0] / seconds[1]:.3f} "
                f"| {np.array_equal(slots_out, pairs_out)} |"
            )
            rows.append(line)
            print(line, flush=True)
            for name, (fn, _) in zip(CASES, built, strict=True):
                ks = trace_calls.trace_kernels(functools.partial(fn, *call_args), 5)
                per_call = kernel_time.kernels_per_call(ks, 5 * args.layers, top=6)
                print(f"  {name}: {per_call}", flush=True)
    layer_stack_probe.print_table(
        "| experts | tokens | slots: ms per layer (of copy) | pairs: ms per layer (of copy) "
        "| slots / pairs | bit-equal |",
        rows,
    )


if __name__ == "__main__":
    main()
