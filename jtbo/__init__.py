"""jtbo: two-batch overlap (TBO) and DP attention for MoE inference in JAX/XLA.

Packages, lowest layer first (each imports only those below it; ``pyproject.toml``'s
import-linter contract checks it): ``jtbo.core`` (integer rounding, argument types),
``jtbo.aot`` and ``jtbo.ffi`` (H200 targets described on a CPU; the peer-copy handlers),
``jtbo.kernels`` (DP memcpy, slice-and-pad, merge, grouped GEMM), ``jtbo.split`` (host
planning, batch pytrees, in-graph split/merge), ``jtbo.collectives`` (DP-attention
gather/scatter, EP dispatch/combine), ``jtbo.attention`` (paged KV cache, native and TBO
backends) and ``jtbo.overlap`` (operations, staggered executor), ``jtbo.models`` (a Flax MoE
model and its TBO step), ``jtbo.runner`` (``ModelRunner``), ``jtbo.analysis`` (a compiled
step's schedule and overlap report) and ``jtbo.info`` (the environment), and at the top
``jtbo.cli`` and ``jtbo.bench``.

The names a user needs are importable from ``jtbo`` itself: the runner and its options, the
model and its config, the batch pytree and its modes, ``make_mesh``, ``from_pretrained``,
and ``configure_platform`` (the CPU with virtual devices where no NVIDIA GPU is present).
"""

import importlib
import importlib.metadata

__all__ = [
    "ForwardBatch",
    "ForwardMode",
    "ModelRunner",
    "MoEConfig",
    "MoEModel",
    "MoEOptions",
    "TboOptions",
    "configure_platform",
    "from_pretrained",
    "make_mesh",
]

_HOMES = {
    "ForwardBatch": "jtbo.split",
    "ForwardMode": "jtbo.split",
    "ModelRunner": "jtbo.runner",
    "MoEConfig": "jtbo.models",
    "MoEModel": "jtbo.models",
    "MoEOptions": "jtbo.models",
    "TboOptions": "jtbo.runner",
    "configure_platform": "jtbo.info.platform",
    "from_pretrained": "jtbo.models.hf",
    "make_mesh": "jtbo.collectives",
}  # name -> the module that defines or re-exports it


def __getattr__(name: str):
    # Lazy so that `import jtbo` does not import jax: `jtbo.configure_platform` and entry
    # points such as `python -m jtbo.demo` must set JAX_PLATFORMS / XLA_FLAGS before jax
    # reads them. __version__ is pyproject.toml's one version string, read from the
    # installed metadata on access (a source tree that is not installed still imports).
    if name == "__version__":
        return importlib.metadata.version("jtbo")
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'jtbo' has no attribute {name!r}")
