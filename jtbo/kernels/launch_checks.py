"""Checks shared by the kernels' launch configs (copy, grouped GEMM, paged attention).

Triton tiles and warp counts are powers of two; the configs refuse other values when they
are built, naming the config class and field, so a bad knob fails before any compile.
"""


def is_power_of_two(value: int) -> bool:
    """True for 1, 2, 4, ..."""
    return value >= 1 and not value & (value - 1)


def require_powers_of_two(config, names) -> None:
    """Raises ValueError naming ``type(config).field`` when a field is not a power of two."""
    for name in names:
        value = getattr(config, name)
        if not is_power_of_two(value):
            raise ValueError(f"{type(config).__name__}.{name} must be a power of two, got {value}")


def require_at_least(config, names, minimum: int) -> None:
    """Raises ValueError naming ``type(config).field`` when a field is below ``minimum``."""
    for name in names:
        value = getattr(config, name)
        if value < minimum:
            raise ValueError(f"{type(config).__name__}.{name} must be >= {minimum}, got {value}")
