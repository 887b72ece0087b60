"""Building and registering the FFI library: the cache, and clear errors."""

import pytest

from jtbo import ffi
from jtbo.ffi import build


def test_unknown_platform_is_refused():
    with pytest.raises(ffi.FfiBuildError, match="not platform='tpu'"):
        ffi.register_peer_exchange("tpu")


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("JTBO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(ffi.FfiBuildError, match="needs `nvcc` on the PATH"):
        build._build("peer_exchange_cuda.cc", "nvcc")


def test_the_library_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JTBO_CACHE_DIR", str(tmp_path))
    first = build._build("peer_exchange_cpu.cc", "c++")
    assert first.parent == tmp_path / "ffi" and first.stat().st_size > 0
    modified = first.stat().st_mtime_ns
    assert build._build("peer_exchange_cpu.cc", "c++") == first
    assert first.stat().st_mtime_ns == modified  # found, not rebuilt


def test_a_compile_error_is_reported_with_the_compiler_output(monkeypatch, tmp_path):
    monkeypatch.setenv("JTBO_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "peer_exchange.h").write_text("")
    (broken / "peer_exchange_cpu.cc").write_text("this is not C++;\n")
    monkeypatch.setattr(build, "SOURCE_DIR", broken)
    with pytest.raises(ffi.FfiBuildError, match="failed"):
        build._build("peer_exchange_cpu.cc", "c++")
