"""Registers and spills of the Mosaic GPU expert kernels, from ptxas, on the CPU (``aot`` extra).

Compiles the grouped FFN's two Mosaic GPU kernels (``grouped_gemm_mosaic`` for bf16 experts,
``grouped_gemm_mosaic_fp8`` for FP8 ones) for one described H200, as ``jtbo.aot`` does, with
Mosaic GPU's ``MOSAIC_GPU_DUMP_PTXAS`` on, and prints per launch shape what ptxas reported for
each kernel: the registers of the launch (the compute warpgroups then raise theirs with
``setmaxnreg``, the memory warpgroup lowers its own) and the bytes it spilled to local memory.
It needs no GPU, so a launch shape's register pressure can be read before it is timed; where
in the kernel the spills sit needs the SASS (``MOSAIC_GPU_DUMP_SASS``, nvdisasm, a GPU
machine).

Usage: ``PYTHONPATH=. python tools/mosaic_ptxas_report.py --preset qwen3-30b-a3b
[--expert-dtype float8_e4m3fn] [--tokens 4096] [--specs "default,128x128x64s4f1p/128x256x64s4f1p"]``
(specs as ``bench grouped_gemm``'s ``mosaic:SPEC``; ``default`` the library's launch shapes).
"""

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def _compile_one(preset: str, expert_dtype: str, tokens: int, spec: str) -> None:
    """Compiles both kernels of one launch shape for an H200 (run in a child process, whose
    environment sets the dump)."""
    import jax.numpy as jnp  # noqa: PLC0415  (the child sets the environment first)

    from jtbo.bench import expert_presets  # noqa: PLC0415
    from jtbo.bench import grouped_gemm as bench  # noqa: PLC0415
    from jtbo.kernels import gemm_config, grouped_gemm_mosaic  # noqa: PLC0415
    from jtbo.kernels import grouped_gemm_mosaic_fp8 as fp8_kernels  # noqa: PLC0415
    from tests.kernels import helpers  # noqa: PLC0415

    grouped_gemm_mosaic.num_clusters = lambda interpret: 66  # an H200's 132 SMs
    shape = expert_presets.PRESETS[preset]
    fp8 = expert_dtype == "float8_e4m3fn"
    rows_per_expert = tokens * shape.top_k / shape.experts  # as the layer's default
    default = gemm_config.default_mosaic_ffn(shape.hidden, shape.ffn, fp8, rows_per_expert)
    cfg = default if spec == "default" else bench.mosaic_config(spec)
    rows = tokens * shape.top_k
    capacity = max(4 * rows // shape.experts, 128)
    shapes = [
        ((shape.experts, capacity, shape.hidden), jnp.bfloat16),
        ((shape.experts,), jnp.int32),
    ]
    if fp8:
        shapes += helpers.fp8_expert_shapes(shape.experts, shape.hidden, shape.ffn)

        def layer(x, counts, *arrays):
            weights = helpers.fp8_experts_of(*arrays)
            return fp8_kernels.grouped_ffn_mosaic_fp8(
                x, counts, *weights, max_rows=rows, cfg=cfg, interpret=False
            ).rows

    else:
        shapes += [((shape.experts, shape.hidden, 2, shape.ffn), jnp.bfloat16)]
        shapes += [((shape.experts, shape.ffn, shape.hidden), jnp.bfloat16)]

        def layer(x, counts, w_gate_up, w_down):
            return grouped_gemm_mosaic.grouped_ffn_mosaic(
                x, counts, w_gate_up, w_down, max_rows=rows, cfg=cfg, interpret=False
            ).rows

    helpers.compiled_for_h200(layer, shapes)


def _report(dump: pathlib.Path) -> str:
    """``gate_up R regs, S/L B spilled; down ...`` from the dump's ptxas logs (kernel order)."""
    parts = []
    for name, path in zip(("gate_up", "down"), sorted(dump.glob("*.ptxas")), strict=False):
        text = path.read_text()
        registers = _REGISTERS.search(text)
        spills = _SPILLS.search(text)
        stores, loads = spills.groups() if spills else ("0", "0")
        parts.append(f"{name} {registers.group(1) if registers else '?'} regs, {stores}/{loads} B")
    return "; ".join(parts) or "no ptxas log"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--expert-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--specs", default="default")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        preset, dtype, tokens, spec = args.child
        _compile_one(preset, dtype, int(tokens), spec)
        return
    print(f"{args.preset}, {args.expert_dtype}, {args.tokens} tokens: ptxas registers of the "
          "launch and spill stores / loads per kernel")  # fmt: skip
    for spec in args.specs.split(","):
        with tempfile.TemporaryDirectory() as dump:
            env = dict(os.environ, JAX_PLATFORMS="cpu", MOSAIC_GPU_DUMP_PTXAS="1")
            env.update(MOSAIC_GPU_DUMP_TO=dump, PYTHONPATH=str(REPO))
            child = [args.preset, args.expert_dtype, str(args.tokens), spec]
            done = subprocess.run(
                [sys.executable, __file__, "--child", *child], env=env, capture_output=True,
                text=True, check=False,
            )  # fmt: skip
            if done.returncode:
                print(f"{spec}: failed ({done.stderr.strip().splitlines()[-1][:200]})")
                continue
            print(f"{spec}: {_report(pathlib.Path(dump))}")


if __name__ == "__main__":
    main()
