"""jtbo's XLA FFI custom calls, built from source on first use (``jtbo.ffi.build``)."""

from jtbo.ffi.build import FfiBuildError, register_peer_exchange

__all__ = ["FfiBuildError", "register_peer_exchange"]
