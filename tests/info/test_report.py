"""``python -m jtbo.info``: every section, optional packages reported as not installed."""

import importlib.metadata

import pytest

from jtbo.info import nccl, packages, report

TITLES = ["system", "packages", "CUDA plugin", "NCCL", "devices", "kernel impls"]


def test_every_section_is_present_on_the_cpu():
    blocks = report.sections()
    assert [b.title for b in blocks] == TITLES
    text = report.render(blocks)
    for title in TITLES:
        assert f"\n{title}:\n" in f"\n{text}\n"
    assert "  xla: runs" in text
    assert "jax-triton runs on GPUs only" in text
    assert "memory: not reported by this backend" in text  # CPU devices report no stats


def test_summary_line_names_versions_devices_and_impls():
    line = report.summary_line()
    assert line.startswith(f"jtbo {importlib.metadata.version('jtbo')} | jax ")
    assert "| cpu x8 | impls: xla, pallas(interpret)" in line
    assert "not started" in report.summary_line(start_backend=False)


def test_summary_line_says_when_jtbo_runs_uninstalled(monkeypatch):
    real = report.packages.package
    monkeypatch.setattr(
        report.packages,
        "package",
        lambda name: report.packages.Package(name, None) if name == "jtbo" else real(name),
    )
    line = report.summary_line(start_backend=False)
    assert line.startswith("jtbo not installed | jax "), line


def _only_jax(monkeypatch):
    real = importlib.metadata.version

    def version(name):
        if name in ("jax", "jaxlib", "jtbo"):
            return real(name)
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_missing_optional_packages_are_reported_not_raised(monkeypatch):
    _only_jax(monkeypatch)
    text = report.render(report.sections())
    for name in ("flax", "triton", "jax-triton", "jax-cuda12-plugin", "nvidia-nccl-cu12"):
        assert f"  {name} {packages.NOT_INSTALLED}" in text, name


def test_a_plugin_at_another_version_is_flagged(monkeypatch):
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: {"jax": "0.12.0"}.get(name, "0.11.2")
    )
    assert "jax-cuda12-plugin 0.11.2 (MISMATCH: jax 0.12.0)" in packages.plugin_lines()


@pytest.mark.parametrize(("code", "text"), [(22703, "2.27.3"), (2804, "2.8.4"), (21903, "2.19.3")])
def test_nccl_version_codes(code, text):
    assert nccl.decode_version(code) == text


def test_an_unloadable_nccl_is_reported(monkeypatch):
    monkeypatch.setattr(nccl, "_LIBRARY", "libnccl-that-does-not-exist.so")
    monkeypatch.setattr(nccl, "_wheel_library", lambda: None)
    assert nccl.library_version().startswith("not available: cannot load")
