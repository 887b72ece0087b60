"""The XLA flags every test process runs with (``tests/conftest.py`` and the child processes).

The tests compile many small programs and run each a few times, so the CPU backend's LLVM
optimisation costs more than it saves: it is turned down. The programs compute the same
operations (HLO passes are unchanged), only their machine code is less optimised, with one
difference seen: unoptimised CPU code flushes some bf16 denormals that it moves. The tests
that check bit patterns (ids bitcast into float rows crossing a collective) compile with
``XLA_DEFAULT_OPTIMIZATION``, XLA's own defaults, as users' programs do.

The H200 programs that the CPU compiles (the ``aot`` extra) skip XLA's GEMM autotuner: with no
GPU to time its candidates, it compiles each candidate config and keeps the first that compiles,
a large part of those tests' time. At level 0 a GEMM takes XLA's default config at once. What
those tests check (collective windows and what runs in them, which kernels read a weight) is
of the program's schedule, not of its GEMM configs; neither choice is what a GPU's autotuner,
which times the candidates, would pick.
They also run ptxas without its optimisations (``--xla_gpu_disable_gpuasm_optimizations``):
no test runs those programs or reads their machine code, and optimising it was a sizeable
part of those tests' time. (Mosaic GPU's kernels call ptxas themselves, as on a GPU.)
"""

_CPU_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_GPU_AOT_FAST_COMPILE = "--xla_gpu_autotune_level=0 --xla_gpu_disable_gpuasm_optimizations=true"
FAST_COMPILE_FLAGS = f"{_CPU_FAST_COMPILE} {_GPU_AOT_FAST_COMPILE}"
# ``jax.jit(..., compiler_options=...)``: XLA's defaults for the two CPU settings above.
XLA_DEFAULT_OPTIMIZATION = {
    "xla_backend_optimization_level": 3,
    "xla_llvm_disable_expensive_passes": False,
}


def with_fast_compile(flags: str) -> str:
    """``flags`` with ``FAST_COMPILE_FLAGS`` appended where it sets no optimisation level."""
    if "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {FAST_COMPILE_FLAGS}".strip()
