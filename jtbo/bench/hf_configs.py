"""A Hugging Face ``config.json`` as a benchmark's model: read, cut to its first layers, mapped.

``bench serve --hf-config`` and ``bench tbo --hf-config`` build a model of a published
family's real dimensions with random weights from its ``config.json`` alone (the files under
``tools/hf_configs/``); ``--num-layers N`` keeps the first N layers, so a model whose weights
would not fit one GPU still runs at its real widths.
"""

import json
from pathlib import Path

from jtbo.models import config as config_lib
from jtbo.models.hf import families


def read_layers(path: Path, num_layers: int | None) -> dict:
    """A ``config.json`` as a dict, cut to its first ``num_layers`` layers when given (the
    per-layer lists too).

    Args:
      path: the ``config.json``.
      num_layers: layers to keep; None keeps them all.

    Returns:
      The config as a dict.

    Raises:
      OSError: the file cannot be read; ValueError: it is not JSON.
    """
    raw = json.loads(path.read_text())
    if num_layers is None:
        return raw
    raw["num_hidden_layers"] = num_layers
    if raw.get("mlp_only_layers"):
        raw["mlp_only_layers"] = [layer for layer in raw["mlp_only_layers"] if layer < num_layers]
    if raw.get("layer_types"):
        raw["layer_types"] = raw["layer_types"][:num_layers]
    return raw


def moe_config(raw: dict) -> config_lib.MoEConfig:
    """The ``MoEConfig`` jtbo maps ``raw`` to (``jtbo.models.hf.families``).

    Raises:
      ValueError: an unsupported ``model_type`` or config field.
    """
    return families.family_of(raw).to_moe_config(raw)
