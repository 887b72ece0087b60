"""What jtbo runs on: ``python -m jtbo.info`` prints versions, devices, NCCL and kernel impls.

``jtbo.info.accelerator`` (``detect_accelerator``) imports only the standard library, so the
Makefile can run it before anything is installed; ``summary_line`` and ``sections``
(``jtbo.info.report``) import jax on first use.
"""

import importlib

__all__ = ["Detection", "detect_accelerator", "install_extras", "sections", "summary_line"]


_HOMES = {
    "Detection": "accelerator",
    "detect_accelerator": "accelerator",
    "install_extras": "accelerator",
    "sections": "report",
    "summary_line": "report",
}  # attribute -> the submodule that defines it


def __getattr__(name: str):
    # Lazy: report imports jax, which must not load before the Makefile installs it, and an
    # eager accelerator import would make `python -m jtbo.info.accelerator` warn (runpy).
    if name in _HOMES:
        return getattr(importlib.import_module(f"jtbo.info.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'jtbo.info' has no attribute {name!r}")
