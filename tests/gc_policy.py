"""The cyclic garbage collector's settings of every test process (``tests/conftest.py`` and the
child processes the multi-process tests start).

Tracing a step program makes hundreds of thousands of short-lived Python objects, and each pass
of the cyclic collector walks every object the imported modules hold (jax, flax, numpy, the
tests): with Python's default thresholds a young pass ran every few hundred allocations. Young
passes every ``THRESHOLDS[0]`` allocations, and the objects alive once the modules are imported
frozen out of the walks (``gc.freeze``), take about 2-5 % off a runner test's time.
"""

import gc

THRESHOLDS = (100_000, 50, 1000)


def collect_less() -> None:
    """Sets the collector's ``THRESHOLDS``."""
    gc.set_threshold(*THRESHOLDS)


def freeze_imported() -> None:
    """Moves every object alive now out of the collector's walks; call once the process has
    imported its modules."""
    gc.freeze()
