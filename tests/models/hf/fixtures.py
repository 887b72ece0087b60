"""The transformers reference fixtures of ``tests/fixtures/hf`` (``tools/make_hf_fixtures.py``)."""

import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3")


def directory(family: str) -> Path:
    """The fixture's model directory."""
    return ROOT / family


def reference(family: str) -> dict:
    """``reference.json``: prompts, their ids, transformers' greedy tokens, versions."""
    return json.loads((directory(family) / "reference.json").read_text())


def reference_logits(family: str) -> list[np.ndarray]:
    """transformers' float32 logits ``[len(prompt), vocab]`` per prompt."""
    with np.load(directory(family) / "reference_logits.npz") as data:
        return [data[f"prompt_{i}"] for i in range(len(data.files))]
