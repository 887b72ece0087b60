"""The XLA flags every test process runs with (``tests/conftest.py`` and the child processes).

The tests compile many small programs and run each a few times, so the CPU backend's LLVM
optimisation costs more than it saves: it is turned down. The programs compute the same
operations (HLO passes are unchanged), only their machine code is less optimised, with one
difference seen: unoptimised CPU code flushes some bf16 denormals that it moves. The tests
that check bit patterns (ids bitcast into float rows crossing a collective) compile with
``XLA_DEFAULT_OPTIMIZATION``, XLA's own defaults, as users' programs do.
"""

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# ``jax.jit(..., compiler_options=...)``: XLA's defaults for the two settings above.
XLA_DEFAULT_OPTIMIZATION = {
    "xla_backend_optimization_level": 3,
    "xla_llvm_disable_expensive_passes": False,
}


def with_fast_compile(flags: str) -> str:
    """``flags`` with ``FAST_COMPILE_FLAGS`` appended where it sets no optimisation level."""
    if "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {FAST_COMPILE_FLAGS}".strip()
