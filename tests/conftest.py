"""Test set-up: the CPU with 8 virtual devices, configured before jax initialises.

``JAX_PLATFORMS`` defaults to ``cpu`` here; on a GPU machine run pytest with
``JAX_PLATFORMS=cuda`` to exercise the GPU paths (kernel impls, ragged EP exchange).
"""

import os

# JAX_PLATFORMS=cpu also keeps the jax-cuda12 plugin (the `aot` extra) from trying to
# initialise CUDA on a machine without a GPU; the 8xH200 topology is still reachable.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

# A persistent compilation cache shared by the run's workers: many tests build runners of the
# same model and compile the same step programs, so each program compiles once per run (and
# once per checkout while jax and the code are unchanged). ``JTBO_TEST_COMPILATION_CACHE=""``
# turns it off.
_CACHE = os.environ.get(
    "JTBO_TEST_COMPILATION_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "build", "jax-compilation-cache"),
)
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

from hypothesis import settings  # noqa: E402

# `pytest --hypothesis-profile=long` runs the fuzz tests (tests/runner/test_fuzz_batches.py)
# with many more examples than `make test` does.
settings.register_profile("long", max_examples=5000, deadline=None)
