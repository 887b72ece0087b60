"""What each operation of a layer costs one GPU, priced from the cost table.

A micro-batch (or a whole plain batch) is described by its token rows on the GPU and its
attention work (``Batch``): fresh prompt chunks for an extend step, sequences at a context
length for a decode step. Each of SGLang's operation names (``jtbo.overlap.strategy``) gets
its compute from the measured table (``step_costs.StepCosts``):

* ``comm_prepare_attn``: residual add and input RMSNorm; ``attn_prepare``: the query and KV
  projections (MLA: through the low ranks, with their norms); ``attn_core``: the attention
  kernel; ``comm_prepare_mlp``: the output projection, residual add and post-attention norm;
* ``mlp`` (dense layers): gate/up and down GEMMs and ``silu * up``;
* ``gate``: the router GEMM; ``select_experts``: sigmoid / softmax top-k;
* ``dispatch_a``: packing one row per (token, destination GPU); ``dispatch_b``: unpacking the
  received rows; ``experts``: the grouped GEMM over the received (token, expert) pairs;
  ``combine_a``: packing the weighted expert outputs; ``combine_b``: summing the received
  partials; ``shared_experts``: the shared-expert MLP; ``output``: the residual add.

**Decode attention** (``DecodeAttention``) is either the table's measured kernel (jtbo's own)
or a memory roofline: the KV cache's bytes over a stated read rate,
``seqs * context * kv_bytes_per_token / rate``, for a kernel that streams the cache once at
that rate (launch floors, the query and the output are left out).

**Exchanges** (their rows, topologies and bytes) are priced by ``step_exchange``.
"""

import dataclasses

from jtbo.analysis import step_costs, step_exchange
from jtbo.models import config as config_lib

BF16 = 2
ATTENTION_PRICES = ("measured", "roofline")


@dataclasses.dataclass(frozen=True)
class Batch:
    """One (micro-)batch's work on one GPU."""

    tokens: float  # token rows on this GPU
    chunks: tuple[tuple[int, int], ...] = ()  # extend: (new tokens, cached prefix) per prompt
    decode_context: int = 0  # decode: context length of each sequence (tokens = sequences)


@dataclasses.dataclass(frozen=True)
class DecodeAttention:
    """How decode attention is priced (module docstring); the default is the table's kernel."""

    price: str = "measured"  # one of ATTENTION_PRICES
    gbps: float | None = None  # roofline only: GB/s the kernel reads the KV cache at

    def __post_init__(self):
        """Checks the fields.

        Raises:
          ValueError: an unknown price, a roofline without a rate > 0, or a rate for the
            measured kernel.
        """
        if self.price not in ATTENTION_PRICES:
            raise ValueError(f"decode attention price {self.price!r}: one of {ATTENTION_PRICES}")
        if self.price == "measured" and self.gbps is not None:
            raise ValueError("the measured decode attention takes no rate (gbps)")
        if self.price == "roofline" and not (self.gbps or 0) > 0:
            raise ValueError(f"a roofline decode attention needs gbps > 0, got {self.gbps}")


def attention_costs(
    costs: step_costs.StepCosts,
    config: config_lib.MoEConfig,
    batch: Batch,
    decode: DecodeAttention = DecodeAttention(),
) -> dict[str, float]:
    """``comm_prepare_attn`` .. ``comm_prepare_mlp`` compute, ms (``decode``: how a decode
    batch's attention kernel is priced)."""
    t, h = batch.tokens, config.hidden_size
    norm = costs.rowwise("add", t, h) + costs.rowwise("rmsnorm", t, h)
    if config.attention_kind == "mla":
        prepare, out_width = (
            _mla_prepare(costs, config, t),
            config.num_attention_heads * config.v_head_dim,
        )
    else:
        heads = config.num_attention_heads + 2 * config.num_key_value_heads
        prepare, out_width = (
            costs.dense_gemm(t, h, heads * config.head_dim),
            config.num_attention_heads * config.head_dim,
        )
    return dict(
        comm_prepare_attn=norm,
        attn_prepare=prepare,
        attn_core=_attention_core(costs, config, batch, decode),
        comm_prepare_mlp=costs.dense_gemm(t, out_width, h) + norm,
    )


def _mla_prepare(costs: step_costs.StepCosts, config: config_lib.MoEConfig, t: float) -> float:
    h, heads = config.hidden_size, config.num_attention_heads
    q_width = heads * config.qk_head_dim
    if config.q_lora_rank is None:
        query = costs.dense_gemm(t, h, q_width)
    else:
        rank = config.q_lora_rank
        query = costs.dense_gemm(t, h, rank) + costs.rowwise("rmsnorm", t, rank)
        query += costs.dense_gemm(t, rank, q_width)
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    return query + costs.dense_gemm(t, h, latent) + costs.rowwise("rmsnorm", t, config.kv_lora_rank)


def _head_scale(costs: step_costs.StepCosts, config: config_lib.MoEConfig, kind: str) -> float:
    """This model's attention work over the measured model's: query heads x head widths."""
    dims = costs.table["attention"][kind].get("dims")
    if not dims:
        return 1.0
    if kind == "mla":
        return config.num_attention_heads / dims["q_heads"]
    mine = config.num_attention_heads * config.head_dim
    return mine / (dims["q_heads"] * dims["head_dim"])


def kv_bytes_per_token(config: config_lib.MoEConfig) -> int:
    """Bytes of one token's bf16 KV cache entry in one layer: MLA's latent and shared RoPE
    key, or GQA's keys and values."""
    if config.attention_kind == "mla":
        return (config.kv_lora_rank + config.qk_rope_head_dim) * BF16
    return 2 * config.num_key_value_heads * config.head_dim * BF16


def roofline_decode_ms(
    config: config_lib.MoEConfig, seqs: float, context: int, gbps: float
) -> float:
    """Decode attention at the memory roofline: ``seqs * context`` cached tokens'
    ``kv_bytes_per_token`` read once at ``gbps`` GB/s, in ms."""
    return seqs * context * kv_bytes_per_token(config) / (gbps * 1e9) * 1e3


def _attention_core(
    costs: step_costs.StepCosts,
    config: config_lib.MoEConfig,
    batch: Batch,
    decode: DecodeAttention,
) -> float:
    kind = config.attention_kind
    if batch.decode_context and decode.price == "roofline":
        return roofline_decode_ms(config, batch.tokens, batch.decode_context, decode.gbps)
    scale = _head_scale(costs, config, kind)
    if batch.decode_context:
        return costs.decode_attention(kind, batch.tokens, batch.decode_context) * scale
    total = sum(
        costs.extend_attention(kind, [new + prefix]) - costs.extend_attention(kind, [prefix])
        for new, prefix in batch.chunks
    )
    return total * scale


def dense_mlp_ms(costs: step_costs.StepCosts, t: float, hidden: int, width: int) -> float:
    """A SwiGLU MLP of ``width`` over ``t`` rows: gate/up, ``silu * up``, down."""
    gate_up = costs.dense_gemm(t, hidden, 2 * width) + costs.rowwise("add", t, 2 * width)
    return gate_up + costs.dense_gemm(t, width, hidden)


def moe_costs(
    costs: step_costs.StepCosts,
    config: config_lib.MoEConfig,
    batch: Batch,
    routing: step_exchange.Routing,
) -> dict[str, float]:
    """``gate`` .. ``output`` compute of a MoE layer, ms."""
    t, h, k = batch.tokens, config.hidden_size, config.num_experts_per_tok
    sent = t * (1 + routing.remote_gpus_per_token) if routing.ep_size > 1 else t
    received = sent * routing.imbalance
    pairs = t * k * routing.imbalance
    return dict(
        gate=costs.dense_gemm(t, h, config.num_experts),
        select_experts=costs.rowwise("routing", t, config.num_experts),
        dispatch_a=costs.rowwise("gather", sent, h),
        dispatch_b=costs.rowwise("gather", received, h),
        experts=costs.grouped_gemm(pairs, routing.local_experts, h, config.moe_intermediate_size),
        combine_a=costs.rowwise("gather", pairs, h),
        shared_experts=dense_mlp_ms(costs, t, h, config.shared_width)
        if config.shared_width
        else 0.0,
        combine_b=costs.rowwise("gather", sent, h),
        output=costs.rowwise("add", t, h),
        comm_postprocess_layer=0.0,
    )
