"""Installed versions of jtbo's dependencies, read from package metadata (nothing imported).

A package that is not installed is reported as such, never as an error: every optional
package (the CUDA plugin, triton, jax-triton, tokamax) is absent on some machines.
"""

import dataclasses
import importlib.metadata

CORE = ("jtbo", "jax", "jaxlib", "flax", "chex", "numpy")  # always installed
OPTIONAL = ("triton", "jax-triton", "tokamax")  # GPU kernels and benches only
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")  # the jax_plugins CUDA backends
CUDA_PJRT = ("jax-cuda12-pjrt", "jax-cuda13-pjrt")  # their PJRT libraries
NOT_INSTALLED = "not installed"


@dataclasses.dataclass(frozen=True)
class Package:
    """One distribution's installed version."""

    name: str  # distribution name, e.g. "jax-cuda12-plugin"
    version: str | None  # None when it is not installed

    def describe(self) -> str:
        """``"name version"`` or ``"name not installed"``."""
        return f"{self.name} {self.version or NOT_INSTALLED}"


def package(name: str) -> Package:
    """The installed version of distribution ``name`` (``version=None`` when absent)."""
    try:
        return Package(name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return Package(name, None)


def plugin_lines() -> list[str]:
    """One line per CUDA plugin / PJRT package: its version and whether it matches jax's.

    The plugin must be at jax's exact version; a mismatch makes jax skip or fail it.
    """
    jax_version = package("jax").version
    lines = []
    for name in CUDA_PLUGINS + CUDA_PJRT:
        found = package(name)
        if found.version is None:
            lines.append(found.describe())
            continue
        match = "matches jax" if found.version == jax_version else f"MISMATCH: jax {jax_version}"
        lines.append(f"{found.describe()} ({match})")
    return lines
