"""jtbo.models.hf: Hugging Face MoE checkpoints (``qwen3_moe``, ``qwen2_moe``, ``mixtral``) in and
out of ``jtbo.models.MoEModel``.

``from_pretrained(path, dtype=, mesh=)`` reads a model directory (``config.json`` plus
safetensors, one file or shards with their index) and places every parameter straight into its
shard on the mesh; ``read_config(path)`` maps its ``config.json`` alone;
``save_pretrained(model, path)`` writes the same layout back, exactly. Modules: ``families``
(config.json <-> ``MoEConfig``), ``tensor_map`` (checkpoint tensor names and the fused jtbo
layouts), ``safetensors_io`` / ``checkpoint`` (files), ``placement`` (checks and sharded
construction), ``loading`` (the entry points).
"""

from jtbo.models.hf.families import FAMILIES
from jtbo.models.hf.loading import from_pretrained, read_config, save_pretrained

__all__ = ["FAMILIES", "from_pretrained", "read_config", "save_pretrained"]
