"""Builds jtbo's XLA FFI libraries from their C++ source on first use, and registers them.

The collectives' peer-copy all-to-all is a pair of FFI handlers in C++:
``peer_exchange_cpu.cc`` for XLA:CPU (built with the host C++ compiler) and
``peer_exchange_cuda.cc`` for CUDA GPUs (built with ``nvcc``, on GPU hosts only). The source
ships inside the package; the shared library is compiled into a cache folder keyed by the
source, the compiler and the jax version, so it is built once per machine, and the targets
are registered with XLA once per process.
"""

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import jax

SOURCE_DIR = pathlib.Path(__file__).parent
START_TARGET = "jtbo_peer_all_to_all_start"
WAIT_TARGET = "jtbo_peer_all_to_all_wait"
EXCHANGE_SCOPE = "jtbo_peer_exchange_"
"""Name-scope prefix under which one exchange's start and wait run (``collectives.peer_copy``),
followed by the exchange's number: the two calls' ``op_name`` metadata pairs them."""

# platform -> (source file, compiler, XLA platform name of the registration)
_BUILDS = {
    "cpu": ("peer_exchange_cpu.cc", "c++", "cpu"),
    "gpu": ("peer_exchange_cuda.cc", "nvcc", "CUDA"),
}
_registered: set[str] = set()
_lock = threading.Lock()


class FfiBuildError(RuntimeError):
    """The FFI library cannot be built or loaded here (no compiler, or a compile error)."""


def register_peer_exchange(platform: str) -> None:
    """Builds (once per machine) and registers (once per process) the peer-copy handlers.

    Args:
      platform: "cpu" or "gpu" (CUDA).

    Raises:
      FfiBuildError: an unsupported platform, no compiler, or the build failed.
    """
    if platform not in _BUILDS:
        raise FfiBuildError(
            f"the peer-copy exchange runs on {sorted(_BUILDS)} devices, not platform={platform!r}"
        )
    with _lock:
        if platform in _registered:
            return
        source, compiler, xla_platform = _BUILDS[platform]
        library = ctypes.cdll.LoadLibrary(str(_build(source, compiler)))
        for target, symbol in (
            (START_TARGET, "JtboPeerAllToAllStart"),
            (WAIT_TARGET, "JtboPeerAllToAllWait"),
        ):
            handler = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(target, handler, platform=xla_platform)
        _registered.add(platform)


def _build(source: str, compiler: str) -> pathlib.Path:
    """The shared library of ``source``, compiled unless the cache already holds it."""
    executable = shutil.which(compiler)
    if executable is None:
        raise FfiBuildError(f"building {source} needs `{compiler}` on the PATH; it was not found")
    inputs = [SOURCE_DIR / source, SOURCE_DIR / "peer_exchange.h"]
    digest = hashlib.sha256()
    for part in [executable, jax.__version__, *(path.read_bytes() for path in inputs)]:
        digest.update(part if isinstance(part, bytes) else part.encode())
    library = _cache_dir() / f"{pathlib.Path(source).stem}-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders (test workers) never see half
    # a library.
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = pathlib.Path(scratch) / library.name
        command = [executable, *_flags(compiler), str(inputs[0]), "-o", str(built)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise FfiBuildError(f"`{' '.join(command)}` failed:\n{done.stderr[-4000:]}")
        os.replace(built, library)
    return library


def _flags(compiler: str) -> list[str]:
    common = ["-std=c++17", "-O2", "-shared", f"-I{jax.ffi.include_dir()}", f"-I{SOURCE_DIR}"]
    if compiler == "nvcc":
        return [*common, "-Xcompiler", "-fPIC"]
    return [*common, "-fPIC"]


def _cache_dir() -> pathlib.Path:
    """``$JTBO_CACHE_DIR/ffi``, else ``$XDG_CACHE_HOME/jtbo/ffi`` (``~/.cache`` by default)."""
    if "JTBO_CACHE_DIR" in os.environ:
        return pathlib.Path(os.environ["JTBO_CACHE_DIR"]) / "ffi"
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jtbo" / "ffi"
