"""Test set-up: the CPU with 8 virtual devices, configured before jax initialises.

``JAX_PLATFORMS`` defaults to ``cpu`` here; on a GPU machine run pytest with
``JAX_PLATFORMS=cuda`` to exercise the GPU paths (kernel impls, ragged EP exchange).
"""

import os
import pathlib

from tests import gc_policy, xla_flags

# JAX_PLATFORMS=cpu also keeps the jax-cuda12 plugin (the `aot` extra) from trying to
# initialise CUDA on a machine without a GPU; the 8xH200 topology is still reachable.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = f"{_flags} --xla_force_host_platform_device_count=8"
if os.environ["JAX_PLATFORMS"].startswith("cpu"):  # GPU kernels keep their optimisation
    _flags = xla_flags.with_fast_compile(_flags)
os.environ["XLA_FLAGS"] = _flags.strip()

# A persistent compilation cache shared by the run's workers and the processes they start
# (set in the environment, which children inherit): many tests build runners of the same model
# and compile the same step programs, so each program compiles once per run (and once per
# checkout while jax and the code are unchanged). ``JTBO_TEST_COMPILATION_CACHE=""`` turns it
# off.
_CACHE = os.environ.get(
    "JTBO_TEST_COMPILATION_CACHE",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "build", "jax-compilation-cache"),
)
if _CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
# On a GPU, float32 matmuls default to TF32 (about 1e-3 relative error), above the tolerances of
# the tests that compare float32 against float64 references; the tests check exactness, so they
# ask for full float32 there. The CPU computes float32 matmuls in full either way.
if not os.environ["JAX_PLATFORMS"].startswith("cpu"):
    jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

gc_policy.collect_less()  # frozen after collection: pytest_runtestloop

# `pytest --hypothesis-profile=long` runs the fuzz tests (tests/runner/test_fuzz_batches.py)
# with many more examples than `make test` does.
settings.register_profile("long", max_examples=5000, deadline=None)


# Test tiers, applied by path so that a new test lands in its file's tier (``--strict-markers``:
# pyproject.toml declares them). ``make test`` runs every tier; ``make test-fast`` leaves out
# ``slow``, ``multiprocess`` and ``wheel``.
_TESTS = pathlib.Path(__file__).parent
TIERS = {
    "multiprocess": (  # jax.distributed runs of several processes
        "runner/test_multihost.py",
        "runner/test_failure_multiprocess.py",
    ),
    "aot": (  # compiles for an 8xH200 target on the CPU (the aot extra)
        "aot/",
        "collectives/test_aot_h200.py",
        "analysis/test_report_cli.py",
    ),
    "slow": (  # files whose tests build and compile whole runners (10 s and more each)
        "runner/test_runner.py",
        "runner/test_tbo_auto.py",
        "runner/test_mla_runner.py",
        "runner/test_token_step.py",
        "runner/test_admission.py",
        "runner/test_generate.py",
        "bench/test_tbo.py",
        "bench/test_step_costs_measure.py",
        "models/hf/test_transformers_reference.py",
        "models/hf/test_fp8_serving.py",
        "models/test_moe_exchange.py",
        "models/test_step.py",
        "models/test_ep_dispatchers.py",
        "kernels/test_slot_rows.py",
        "test_readme.py",
    ),
}


def _tiers(path: pathlib.Path) -> list[str]:
    relative = path.relative_to(_TESTS).as_posix()
    return [tier for tier, prefixes in TIERS.items() if relative.startswith(prefixes)]


_SHARED_SCOPES = ("class", "module", "package")


def _shares_fixtures(item) -> bool:
    """Whether the test uses a fixture that outlives it within its file (one built runner or
    model, say): such tests run on one xdist worker, which builds it once."""
    definitions = item._fixtureinfo.name2fixturedefs.values()
    return any(defs[-1].scope in _SHARED_SCOPES for defs in definitions)


# Files whose tests take the longest (whole runners, several processes) are handed out first,
# so that no long group starts last and runs alone on one worker while the other waits.
_FIRST_TIERS = ("multiprocess", "slow")


# Before xdist's own hook, which reads the ``xdist_group`` marks to put each group on one worker.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks every test with the tiers of its file (``TIERS``), groups the tests of a file on
    one xdist worker where they share fixtures (``make test``'s ``--dist loadgroup``; the
    others spread over the workers one by one), and puts the slow tiers' files first."""
    for item in items:
        path = pathlib.Path(item.fspath)
        for tier in _tiers(path):
            item.add_marker(getattr(pytest.mark, tier))
        if _shares_fixtures(item):
            item.add_marker(pytest.mark.xdist_group(path.relative_to(_TESTS).as_posix()))
    items.sort(key=lambda item: not any(item.get_closest_marker(t) for t in _FIRST_TIERS))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    """Refuses a ``--dist loadgroup`` run whose groups xdist did not take: each grouped test's
    id must end in ``@group``. (pytest 9.2 keeps ids where xdist 3.8 cannot append it, and the
    grouped files would then build their shared fixtures once per worker.)"""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    grouped = [item for item in session.items if item.get_closest_marker("xdist_group")]
    lost = [item.nodeid for item in grouped if "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(
            f"--dist loadgroup did not group {len(lost)} tests (first: {lost[0]}); "
            "this pytest / pytest-xdist pair does not support xdist_group"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Before the first test: moves every object alive after collection (the modules and what
    they hold) out of the cyclic collector's walks (``gc_policy``); returns ``None``, so
    pytest's own loop runs the tests."""
    gc_policy.freeze_imported()


def _skip_on_too_few_devices():
    """Turns a mesh the host has too few devices for into a skip that says how many it needs
    (a one-GPU host runs the tests written for the CPU's 8 virtual devices)."""
    from jtbo.collectives import mesh as mesh_lib

    try:
        return (yield)
    except mesh_lib.TooFewDevicesError as error:
        pytest.skip(f"needs {error.needed} devices, this host has {error.available}")


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(
    lambda item: (yield from _skip_on_too_few_devices())
)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(
    lambda item: (yield from _skip_on_too_few_devices())
)
