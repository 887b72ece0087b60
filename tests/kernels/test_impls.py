"""Impl selection: names, defaults per backend, and clear errors."""

import jax
import jax.numpy as jnp
import pytest

from jtbo import kernels
from jtbo.kernels import impls


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU backend")
def test_triton_unavailable_on_cpu_names_impl_and_reason():
    x = jnp.ones((4, 2), jnp.float32)
    with pytest.raises(kernels.KernelUnavailableError, match=r"impl='triton'.*GPUs only"):
        kernels.slice_pad(x, 0, 2, capacity=4, impl="triton")
    with pytest.raises(kernels.KernelUnavailableError, match=r"impl='triton'"):
        kernels.dp_memcpy(x, x, 0, 2, offset_src=True, impl="triton")
    with pytest.raises(kernels.KernelUnavailableError, match=r"impl='triton'"):
        kernels.merge_rows([x], [0], [2], out_len=4, impl="triton")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU backend")
def test_default_on_cpu_is_xla():
    assert all(impls.resolve(None, op=op) == "xla" for op in impls.FASTEST)


def test_default_is_available_here():
    for op in impls.FASTEST:
        assert impls.unavailable_reason(impls.resolve(None, op=op), jax.default_backend()) is None


def test_gpu_defaults_follow_measurement(monkeypatch):
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    monkeypatch.setattr(impls, "unavailable_reason", lambda impl, platform: None)
    assert impls.resolve(None, op="dp_memcpy", payload_bytes=1 << 20) == "pallas"
    assert impls.resolve(None, op="slice_pad") == "xla"
    assert impls.resolve(None, op="merge_rows") == "xla"
    assert impls.resolve(None, op="grouped_ffn") == "pallas"
    assert impls.resolve(None, op="paged_attention") == "pallas"
    # A small-copy threshold sends small payloads to XLA; 0 means there is none.
    assert impls.resolve(None, op="dp_memcpy", payload_bytes=10, xla_below_bytes=64) == "xla"


def test_unknown_impl_raises():
    with pytest.raises(ValueError, match="impl must be one of"):
        impls.resolve("cuda", op="dp_memcpy")


def test_pallas_int32_guard():
    with pytest.raises(kernels.KernelUnavailableError, match="int32"):
        impls.check_pallas_elems((2**31 - 10,), 16)
    impls.check_pallas_elems((2**31 - 17,), 16)


def test_default_small_copies_take_xla(monkeypatch):
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    monkeypatch.setattr(impls, "unavailable_reason", lambda impl, platform: None)
    small, large = {"payload_bytes": 4096}, {"payload_bytes": 2 << 20}
    assert impls.resolve(None, op="dp_memcpy", **small, xla_below_bytes=1 << 20) == "xla"
    assert (
        impls.resolve(None, op="dp_memcpy", **large, xla_below_bytes=1 << 20)
        == impls.FASTEST["dp_memcpy"]["gpu"][0]
    )
    assert impls.resolve("pallas", op="dp_memcpy", **small, xla_below_bytes=1 << 20) == "pallas"


def test_mosaic_is_an_impl_of_grouped_ffn_only():
    assert impls.MOSAIC in impls.op_impls("grouped_ffn")
    assert impls.MOSAIC not in impls.op_impls("dp_memcpy")
    with pytest.raises(ValueError, match="dp_memcpy: impl must be one of"):
        impls.resolve("mosaic", op="dp_memcpy")
    assert impls.resolve("mosaic", op="grouped_ffn") == "mosaic"  # the interpreter on CPUs


def test_mosaic_needs_a_hopper_gpu(monkeypatch):
    class Ampere:
        compute_capability = "8.0"

    monkeypatch.setattr(jax, "devices", lambda: [Ampere()])
    assert "compute capability 9.x" in impls.unavailable_reason("mosaic", "gpu")
    assert "NVIDIA GPUs only" in impls.unavailable_reason("mosaic", "tpu")
