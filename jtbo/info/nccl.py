"""The NCCL version: from the ``nvidia-nccl-cu12`` / ``-cu13`` wheel and from the library.

Reading the library calls ``ncclGetVersion`` through ctypes; a library that cannot be found
or loaded is reported with the reason, never raised.
"""

import ctypes
import importlib.util
import pathlib

from jtbo.info import packages

NCCL_WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu13")  # pip wheels that ship libnccl
_LIBRARY = "libnccl.so.2"


def _wheel_library() -> pathlib.Path | None:
    """The libnccl inside the ``nvidia.nccl`` wheel package, if that is installed."""
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "lib" / _LIBRARY
    return path if path.exists() else None


def decode_version(code: int) -> str:
    """``ncclGetVersion``'s integer as ``major.minor.patch`` (codes since NCCL 2.9: 22703)."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def library_version() -> str:
    """The version the loadable libnccl reports, or ``"not available: <reason>"``."""
    target = _wheel_library() or _LIBRARY
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        return f"not available: cannot load {target} ({err})"
    code = ctypes.c_int(0)
    status = lib.ncclGetVersion(ctypes.byref(code))
    if status != 0:
        return f"not available: ncclGetVersion returned {status}"
    return f"{decode_version(code.value)} ({target})"


def nccl_lines() -> list[str]:
    """The NCCL wheels' versions and the loadable library's version."""
    lines = [packages.package(name).describe() for name in NCCL_WHEELS]
    lines.append(f"libnccl: {library_version()}")
    return lines
