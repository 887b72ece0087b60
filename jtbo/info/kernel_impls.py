"""Which kernel impls (``xla``, ``pallas``, ``triton``, ``mosaic``) run on this backend, and why
not.

The checks are ``jtbo.kernels.impls.unavailable_reason``'s; this module only words them.
"""

from jtbo.kernels import impls


def impl_status(impl: str, platform: str) -> str:
    """``impl``'s status on ``platform``: ``"runs"``, ``"runs (interpreter)"`` or why not."""
    reason = impls.unavailable_reason(impl, platform)
    if reason is not None:
        return f"unavailable: {reason}"
    if impl == "pallas" and platform == "cpu":
        return "runs (Pallas interpreter: for tests, not speed)"
    if impl == impls.MOSAIC and platform == "cpu":
        return "runs (Mosaic GPU interpreter: for tests, not speed)"
    return "runs"


def impl_lines() -> list[str]:
    """One line per impl in ``impls.IMPLS``, then ``mosaic`` (its ops named), for the default
    backend."""
    platform = impls.backend()
    lines = [f"{impl}: {impl_status(impl, platform)}" for impl in impls.IMPLS]
    ops = ", ".join(impls.MOSAIC_OPS)
    return lines + [f"{impls.MOSAIC} ({ops}): {impl_status(impls.MOSAIC, platform)}"]


def available_phrase() -> str:
    """The impls that run here, e.g. ``"xla, pallas(interpret)"``."""
    platform = impls.backend()
    names = []
    for impl in impls.IMPLS:
        if impls.unavailable_reason(impl, platform) is None:
            interpreted = impl == "pallas" and platform == "cpu"
            names.append(f"{impl}(interpret)" if interpreted else impl)
    return ", ".join(names)
