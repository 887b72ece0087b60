"""Model families' published routed-expert shapes, for ``bench grouped_gemm --preset NAME``.

Each preset copies four fields of the family's Hugging Face ``config.json``: the hidden size,
one routed expert's intermediate size (``moe_intermediate_size``; Mixtral, whose experts are
its MLPs, ``intermediate_size``), the number of routed experts (``num_experts``,
``n_routed_experts`` or ``num_local_experts``) and the experts each token picks
(``num_experts_per_tok``). Shared experts are left out: the benchmark times the routed layer.
"""

import dataclasses
import types


@dataclasses.dataclass(frozen=True)
class ExpertPreset:
    """One model family's routed-expert shape.

    Attributes:
      name: the ``--preset`` name.
      hf_model: the Hugging Face model whose ``config.json`` gives the shape.
      hidden: H, the hidden size.
      ffn: F, one routed expert's intermediate size.
      experts: E, the routed experts.
      top_k: the routed experts each token picks.
    """

    name: str
    hf_model: str
    hidden: int
    ffn: int
    experts: int
    top_k: int

    def shape_flags(self) -> dict[str, int]:
        """The shape as ``bench grouped_gemm`` flag values: ``hidden``, ``ffn``, ``experts``,
        ``top_k``."""
        return dict(hidden=self.hidden, ffn=self.ffn, experts=self.experts, top_k=self.top_k)


PRESETS = types.MappingProxyType(
    {
        preset.name: preset
        for preset in (
            ExpertPreset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 2048, 768, 128, 8),
            ExpertPreset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 4096, 1536, 128, 8),
            ExpertPreset("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", 2048, 1408, 64, 6),
            ExpertPreset("deepseek-v3", "deepseek-ai/DeepSeek-V3", 7168, 2048, 256, 8),
            ExpertPreset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 4096, 14336, 8, 2),
        )
    }
)
"""The presets by name (read-only)."""
