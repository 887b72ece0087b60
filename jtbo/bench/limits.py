"""A plain step's physical limit: its useful work at the device's measured rates.

* **Prefill (extend)** is compute-bound. Its useful work is one multiply-add per token for
  every weight the token passes through: the attention projections (MLA's up-projection
  included: extend steps up-project every token's latent once), the dense MLP of the first
  layers, the router, ``num_experts_per_tok`` routed experts and the shared experts of each
  MoE layer, and the LM head; plus the causal attention itself, ``heads x (qk + v)``
  multiply-adds per visible (query, key) pair. Capacity padding, dropped-slot recomputation
  and everything that is not a matmul count as overhead, not work. The limit is those FLOPs
  at the measured dense bf16 matmul rate (``device_rates.matmul_tflops``).
* **Decode** is memory-bound. Its useful traffic is every weight the step multiplies by, read
  once (a device holds ``1 / num_devices`` of the routed experts, and a decode batch is
  assumed to reach all of them), plus the KV cache its sequences attend. The embedding
  table is gathered, not read, and is left out. The limit is those bytes at the measured
  copy bandwidth (``device_rates.copy_gbs``).

Both are per device for a DP rank of one device (``attn_tp`` 1), with the routed experts
balanced over the devices.
"""

import dataclasses

from jtbo.models import config as config_lib
from jtbo.models import param_bytes

UNIT_SCALES = {"TFLOP": 1e12, "GB": 1e9}
"""``Limit.unit`` -> what one unit of work is (FLOPs or bytes)."""


def _attention_weights(config: config_lib.MoEConfig) -> int:
    """Weights one token multiplies by in one layer's attention projections."""
    h, heads = config.hidden_size, config.num_attention_heads
    if config.attention_kind == "mla":
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        rank, q_rank = config.kv_lora_rank, config.q_lora_rank
        q = h * q_rank + q_rank * heads * qk if q_rank else h * heads * qk
        kv_a = h * (rank + config.qk_rope_head_dim)
        kv_b = rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        return q + kv_a + kv_b + heads * config.v_head_dim * h
    qkv = h * (heads + 2 * config.num_key_value_heads) * config.head_dim
    return qkv + heads * config.head_dim * h


def _ffn_weights(config: config_lib.MoEConfig, moe: bool) -> tuple[int, int]:
    """``(weights every token multiplies by, one routed expert's weights)`` of a layer's FFN."""
    h = config.hidden_size
    if not moe:
        return 3 * h * config.intermediate_size, 0
    shared = 3 * h * config.shared_width + (h if config.shared_expert_gate else 0)
    return h * config.num_experts + shared, 3 * h * config.moe_intermediate_size


def _layer_weights(config: config_lib.MoEConfig) -> tuple[int, int]:
    """``(weights every token multiplies by, routed-expert weights of all layers)``: all
    layers and the LM head; the second counts every expert once."""
    dense = config.hidden_size * config.vocab_size  # the LM head
    routed = 0
    for moe in config.is_moe_layer:
        shared, expert = _ffn_weights(config, moe)
        dense += _attention_weights(config) + shared
        routed += expert * config.num_experts
    return dense, routed


def attention_pairs(seq_lens: list[int]) -> int:
    """Visible (query, key) pairs of fresh causal prompts of ``seq_lens`` tokens."""
    return sum(n * (n + 1) // 2 for n in seq_lens)


def prefill_flops(config: config_lib.MoEConfig, seq_lens: list[int]) -> float:
    """Useful FLOPs of a plain extend step of fresh prompts (module docstring).

    Args:
      config: the model.
      seq_lens: the prompts' lengths on the DP rank.

    Returns:
      FLOPs (2 per multiply-add).
    """
    tokens = sum(seq_lens)
    dense, routed = _layer_weights(config)
    per_token = dense + routed * config.num_experts_per_tok // config.num_experts
    if config.attention_kind == "mla":
        qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        qk = v = config.head_dim
    per_pair = config.num_attention_heads * (qk + v) * config.num_layers
    return 2.0 * (tokens * per_token + attention_pairs(seq_lens) * per_pair)


def kv_bytes_per_token(config: config_lib.MoEConfig, itemsize: int) -> int:
    """KV-cache bytes of one token over all layers (one DP rank of one device)."""
    heads, key_width, value_width = config.kv_pool_heads(1)
    return config.num_layers * heads * (key_width + value_width) * itemsize


def decode_bytes(
    config: config_lib.MoEConfig, context_tokens: int, num_devices: int, itemsize: int
) -> float:
    """Bytes one device reads in a plain decode step (module docstring).

    Args:
      config: the model.
      context_tokens: KV positions the step's sequences attend, summed over them.
      num_devices: devices the routed experts are spread over.
      itemsize: bytes per weight (but FP8 routed experts, ``MoEConfig.expert_dtype``) and
        per KV value.

    Returns:
      Weight bytes plus KV bytes.
    """
    dense, _ = _layer_weights(config)
    # The routed experts at their own storage (FP8 experts: a byte per value and the scales).
    routed = param_bytes.parameter_bytes(config, itemsize).routed_experts
    weights = dense * itemsize + routed / num_devices
    return weights + context_tokens * kv_bytes_per_token(config, itemsize)


@dataclasses.dataclass(frozen=True)
class Limit:
    """A step's physical limit.

    Attributes:
      work: useful FLOPs (prefill) or bytes (decode).
      unit: a key of ``UNIT_SCALES``: "TFLOP" or "GB" (``work`` / 1e12 or 1e9).
      rate: the measured rate in ``unit`` per second.
      rate_label: how the rate was measured.
    """

    work: float
    unit: str
    rate: float
    rate_label: str

    @property
    def units(self) -> float:
        """``work`` in ``unit`` (TFLOP or GB)."""
        return self.work / UNIT_SCALES[self.unit]

    @property
    def milliseconds(self) -> float:
        """The limit's time: ``work`` at ``rate``."""
        return self.units / self.rate * 1e3

    def describe(self, step_ms: float, device_ms: float | None = None) -> str:
        """``"19.31 TFLOP at 712 TFLOP/s (label) = 27.12 ms; step 42.25 ms = 1.56x"``, and with
        ``device_ms`` (the devices' time per step, the host's hidden)
        ``"...; device step 30.10 ms = 1.11x"``."""
        line = (
            f"{self.units:.2f} {self.unit} at {self.rate:.0f} {self.unit}/s "
            f"({self.rate_label}) = {self.milliseconds:.2f} ms; step {step_ms:.2f} ms = "
            f"{step_ms / self.milliseconds:.2f}x"
        )
        if device_ms is None:
            return line
        return f"{line}; device step {device_ms:.2f} ms = {device_ms / self.milliseconds:.2f}x"
