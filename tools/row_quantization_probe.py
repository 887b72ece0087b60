"""Probe: where and how the FP8 experts' rows are quantized, side by side in one process, in
a stack of FP8 layers (``layer_stack_probe.stack``, ``"auto"``):

* ``unguarded``: ``quantize_blocks`` alone before the kernel (XLA may then quantize a layer's
  unrounded float32 output: its excess precision);
* ``quantize_rows`` (the library's): an optimization barrier first, so the rows are the values
  of their own dtype;
* ``in kernel``: the Pallas gate / up kernel quantizes the source rows (one per token) as it
  loads them, as it does slot rows: no quantization fusions before it, each column tile
  quantizing the rows again.

Prints ms per layer of each (weight bytes per second over the copy ceiling) and each case's
output against ``quantize_rows``'s (bit-equal, largest difference over the largest value); a
markdown table last.

``PYTHONPATH=.:tools python tools/row_quantization_probe.py [--tokens 64,128,256,4096]
[--layers 8]`` (a GPU)
"""

import layer_stack_probe
import numpy as np

from jtbo.bench import device_rates
from jtbo.kernels import fp8_blocks, grouped_gemm

CASES = {
    "unguarded": (
        (fp8_blocks, "quantize_rows", lambda x, group: fp8_blocks.quantize_blocks(x, (1, group))),
    ),
    "quantize_rows": (),
    "in kernel": (
        (grouped_gemm, "_rows_quantized_in_kernel", lambda source, block_k, qk: block_k == qk),
    ),
}


def _agreement(out, reference) -> str:
    diff = np.abs(out - reference).max() / np.abs(reference).max()
    return f"{np.array_equal(out, reference)} ({diff:.1e})"


def main() -> None:
    args, shapes, copy_gbs = layer_stack_probe.setup(__doc__, dtypes=False)
    layer_weights = layer_stack_probe.layer_weights_of(shapes, args.layers, "fp8")
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        call_args = layer_stack_probe.stack_args(shapes, tokens, layer_weights)
        built = {
            name: layer_stack_probe.compiled(layer_stack_probe.stack, call_args, patches)
            for name, patches in CASES.items()
        }
        cases = [(fn, call_args) for fn, _ in built.values()]
        seconds = device_rates.time_fns_interleaved(cases, warmup=2, iters=10, reps=7)
        gbytes = layer_stack_probe.weight_gb(shapes, call_args[1], "fp8")
        per_layer = [s / args.layers for s in seconds]
        timed = layer_stack_probe.per_layer_cells(per_layer, gbytes, copy_gbs, digits=4)
        reference = built["quantize_rows"][1]
        agree = [_agreement(out, reference) for name, (_, out) in built.items()]
        line = f"| {tokens} | {' | '.join(timed)} | {agree[0]} | {agree[2]} |"
        rows.append(line)
        print(line, flush=True)
    layer_stack_probe.print_table(
        "| tokens | "
        + " | ".join(f"{name}: ms per layer (of copy)" for name in CASES)
        + " | unguarded = quantize_rows | in kernel = quantize_rows |",
        rows,
    )


if __name__ == "__main__":
    main()
