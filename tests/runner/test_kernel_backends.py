"""The runner's default kernels: the fastest measured on the platform, a name as given."""

import pytest

from jtbo.kernels import impls
from jtbo.runner import kernel_backends


def test_cpu_defaults_are_the_xla_references():
    assert kernel_backends.moe_runner_backend(None) == "xla"
    assert kernel_backends.attention_backend(None) == "native"


def test_gpu_defaults_are_the_kernels(monkeypatch):
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    assert kernel_backends.moe_runner_backend(None) == "pallas"
    assert kernel_backends.attention_backend(None) == "pallas"
    assert kernel_backends.attention_backend(None, "mla") == "native"  # no MLA kernel


@pytest.mark.parametrize("name", ["xla", "pallas"])
def test_a_named_backend_is_kept(monkeypatch, name):
    monkeypatch.setattr(impls, "backend", lambda: "gpu")
    assert kernel_backends.moe_runner_backend(name) == name
    assert kernel_backends.attention_backend("native") == "native"
