"""The XLA flags every test process runs with (``tests/conftest.py`` and the child processes).

The tests compile many small programs and run each a few times, so the CPU backend's LLVM
optimisation costs more than it saves: it is turned down. The programs compute the same
operations (HLO passes are unchanged), only their machine code is less optimised.
"""

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def with_fast_compile(flags: str) -> str:
    """``flags`` with ``FAST_COMPILE_FLAGS`` appended where it sets no optimisation level."""
    if "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {FAST_COMPILE_FLAGS}".strip()
