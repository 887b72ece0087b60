"""jtbo: two-batch overlap (TBO) and DP attention for MoE inference in JAX/XLA.

Packages, lowest layer first: ``jtbo.kernels`` (DP memcpy, slice-and-pad, merge),
``jtbo.split`` (host planning, batch pytrees, in-graph split/merge), ``jtbo.collectives``
(DP-attention gather/scatter, EP dispatch/combine), ``jtbo.attention``
(paged KV cache, native and TBO backends), ``jtbo.overlap`` (operations, staggered executor,
overlap report), ``jtbo.models`` (a Flax MoE model and its TBO step) and ``jtbo.runner``
(``ModelRunner``).
"""

import importlib.metadata

__all__ = ["ModelRunner"]


def __getattr__(name: str):
    # Lazy so that `import jtbo` does not import jax: entry points such as `python -m
    # jtbo.demo` must set JAX_PLATFORMS / XLA_FLAGS before jax reads them.
    # __version__ is pyproject.toml's one version string, read from the installed metadata
    # on access (a source tree that is not installed still imports).
    if name == "__version__":
        return importlib.metadata.version("jtbo")
    if name == "ModelRunner":
        from jtbo.runner import runner

        return runner.ModelRunner
    raise AttributeError(f"module 'jtbo' has no attribute {name!r}")
