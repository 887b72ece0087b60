"""The runner's default kernels: the fastest measured on the platform, a name as given."""

import functools

import pytest

from jtbo.kernels import impls
from jtbo.runner import kernel_backends


def test_cpu_defaults_are_the_xla_references():
    assert kernel_backends.moe_runner_backend(None) == "xla"
    assert kernel_backends.attention_backend(None) == "native"


def test_gpu_defaults_are_the_kernels(monkeypatch):
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    assert kernel_backends.moe_runner_backend(None) == "auto"
    assert kernel_backends.attention_backend(None) == "pallas"
    assert kernel_backends.attention_backend(None, "mla", (512, 128), (64, 192)) == "pallas"


@pytest.mark.parametrize("name", ["xla", "pallas", "mosaic", "auto"])
def test_a_named_backend_is_kept(monkeypatch, name):
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    assert kernel_backends.moe_runner_backend(name) == name
    assert kernel_backends.attention_backend("native") == "native"


def test_gpu_defaults_skip_kernels_whose_tiles_do_not_fit(monkeypatch):
    # A model the kernels cannot tile gets the XLA path by default (a named kernel still
    # raises where it is built): expert widths not in multiples of 16, widths loaded whole
    # that are not powers of two >= 16, widths loaded in parts that are not multiples of 16.
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    assert kernel_backends.moe_runner_backend(None, (7168, 2048)) == "auto"
    assert kernel_backends.moe_runner_backend(None, (64, 40)) == "xla"
    assert kernel_backends.attention_backend(None, "gqa", (128,)) == "pallas"
    assert kernel_backends.attention_backend(None, "gqa", (96,)) == "native"
    assert kernel_backends.attention_backend(None, "gqa", (8,)) == "native"
    mla = functools.partial(kernel_backends.attention_backend, None, "mla")
    assert mla((512, 128), (64, 192)) == "pallas"  # DeepSeek-V3: 128 + 64 key parts
    assert mla((512, 128), (48, 176)) == "pallas"  # 32 + 16 and 128 + 32 + 16
    assert mla((512, 96), (64, 192)) == "native"  # the value head is loaded whole
    assert mla((512, 128), (64, 200)) == "native"  # 200 = 128 + 64 + 8
    assert mla((12, 16), (16, 32)) == "native"


def test_a_triton_default_needs_keys_in_at_most_two_parts(monkeypatch):
    # Where the Triton kernels rank first, a key loaded in three parts keeps the reference.
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    monkeypatch.setattr(impls, "unavailable_reason", lambda impl, platform: None)
    monkeypatch.setitem(impls.FASTEST, "mla_latent_attention", {"gpu": ("triton", "xla")})
    monkeypatch.setitem(impls.FASTEST, "paged_attention", {"gpu": ("triton", "xla")})
    assert kernel_backends.attention_backend(None, "gqa", (128,)) == "triton"
    mla = functools.partial(kernel_backends.attention_backend, None, "mla")
    assert mla((512, 128), (64, 192), key_parts=2) == "triton"
    assert mla((512, 128), (96, 160), key_parts=3) == "native"  # the latent row: 512 + 64 + 32
    assert mla((512, 128), (96, 160), key_parts=3) != kernel_backends.attention_backend(
        None, "mla", (512, 128), (96, 160), key_parts=2
    )  # the part count alone decides (96 and 160 are two parts each)
