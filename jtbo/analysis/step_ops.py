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

**Per-call floors.** The table times each operation as its own host-dispatched call, so
a small call's time is mostly a per-call floor (dispatch, launch, the wait), not work: its
curves are flat at small sizes (row-wise operations, decode attention, whose time grows with
the KV rows read at about the device's copy rate on top of that floor). Inside a step every
operation is one kernel of one program. An operation with no weights, whose work is its rows
(the row-wise operations, decode attention), is therefore priced for a micro-batch as its
share of the whole step's call (``rowwise_ms``, ``Batch.step_tokens``): the two
micro-batches of a TBO step together cost what the plain step's call costs, the floor counted
once, as in the plain step. GEMMs keep a lookup per micro-batch: each micro-batch reads their
weights again, which is work.

**Expert GEMMs** (``ExpertGemm``) are the table's bf16 layer, or FP8 weights and activations
(as DeepGEMM runs them) priced from it: the bf16 time scaled by the FP8 weight bytes' ratio
where the measured layer is weight-bound and by a stated FP8-over-bf16 rate where it is
compute-bound (``StepCosts.grouped_gemm_fp8``). Only the routed experts: the other GEMMs
stay bf16.

**Exchanges** (their rows, topologies and bytes) are priced by ``step_exchange``.
"""

import dataclasses

from jtbo.analysis import step_costs, step_exchange
from jtbo.models import config as config_lib

BF16 = 2
ATTENTION_PRICES = ("measured", "roofline")
EXPERT_GEMM_DTYPES = ("bf16", "fp8")


@dataclasses.dataclass(frozen=True)
class Batch:
    """One (micro-)batch's work on one GPU."""

    tokens: float  # token rows on this GPU
    chunks: tuple[tuple[int, int], ...] = ()  # extend: (new tokens, cached prefix) per prompt
    decode_context: int = 0  # decode: context length of each sequence (tokens = sequences)
    step_tokens: float | None = None  # a micro-batch: the whole step's rows (None: this batch)

    @property
    def step_rows(self) -> float:
        """Token rows of the whole step this batch belongs to."""
        return self.tokens if self.step_tokens is None else self.step_tokens


@dataclasses.dataclass(frozen=True)
class ExpertGemm:
    """How the routed experts' grouped GEMM is priced (module docstring, "Expert GEMMs"); the
    default is the table's bf16 layer."""

    dtype: str = "bf16"  # one of EXPERT_GEMM_DTYPES
    fp8_speedup: float | None = None  # fp8 only: the FP8 GEMM rate over the bf16 rate

    def __post_init__(self):
        """Checks the fields.

        Raises:
          ValueError: an unknown dtype, FP8 without a speedup >= 1, or a speedup for bf16.
        """
        if self.dtype not in EXPERT_GEMM_DTYPES:
            raise ValueError(f"expert GEMM dtype {self.dtype!r}: one of {EXPERT_GEMM_DTYPES}")
        if self.dtype == "bf16" and self.fp8_speedup is not None:
            raise ValueError("bf16 expert GEMMs take no FP8 speedup")
        if self.dtype == "fp8" and not (self.fp8_speedup or 0) >= 1:
            raise ValueError(f"FP8 expert GEMMs need fp8_speedup >= 1, got {self.fp8_speedup}")


def fp8_weight_byte_ratio(config: config_lib.MoEConfig) -> float:
    """Bytes of block-scaled FP8 expert weights over bf16 ones.

    Args:
      config: the model (``expert_block_size``: values sharing one float32 scale).

    Returns:
      A byte per value plus a float32 scale per block, over two bytes per value.
    """
    rows, cols = config.expert_block_size
    return (1 + step_exchange.SCALE_BYTES / (rows * cols)) / BF16


def experts_ms(
    costs: step_costs.StepCosts, config: config_lib.MoEConfig, pairs: float, local: int,
    gemm: ExpertGemm = ExpertGemm(),
) -> float:  # fmt: skip
    """The routed experts' GEMMs: the table's bf16 layer, or FP8 priced from it
    (``StepCosts.grouped_gemm_fp8``).

    Args:
      costs: the cost table.
      config: the model (its expert shape and FP8 weight blocks).
      pairs: (token, expert) rows on this GPU.
      local: experts on this GPU.
      gemm: bf16, or FP8 with its speedup.

    Returns:
      Milliseconds.
    """
    h, ffn = config.hidden_size, config.moe_intermediate_size
    if gemm.dtype == "bf16":
        return costs.grouped_gemm(pairs, local, h, ffn)
    ratio = fp8_weight_byte_ratio(config)
    return costs.grouped_gemm_fp8(pairs, local, h, ffn, gemm.fp8_speedup, ratio)


def rowwise_ms(
    costs: step_costs.StepCosts, op: str, batch: Batch, width: int, per_token: float = 1.0
) -> float:
    """A row-wise operation over ``per_token`` rows of ``width`` per token row of ``batch``,
    as the batch's share of the whole step's one call (module docstring, "Per-call floors").

    Args:
      costs: the cost table.
      op: one of ``step_costs.ROWWISE_OPS``.
      batch: the (micro-)batch.
      width: values per row.
      per_token: rows of the operation per token row (e.g. rows sent per token).

    Returns:
      Milliseconds.
    """
    whole = batch.step_rows
    if whole <= 0:
        return 0.0
    return costs.rowwise(op, per_token * whole, width) * batch.tokens / whole


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
    norm = rowwise_ms(costs, "add", batch, h) + rowwise_ms(costs, "rmsnorm", batch, h)
    if config.attention_kind == "mla":
        prepare, out_width = (
            _mla_prepare(costs, config, batch),
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


def _mla_prepare(costs: step_costs.StepCosts, config: config_lib.MoEConfig, batch: Batch) -> float:
    t, h, heads = batch.tokens, config.hidden_size, config.num_attention_heads
    q_width = heads * config.qk_head_dim
    if config.q_lora_rank is None:
        query = costs.dense_gemm(t, h, q_width)
    else:
        rank = config.q_lora_rank
        query = costs.dense_gemm(t, h, rank) + rowwise_ms(costs, "rmsnorm", batch, rank)
        query += costs.dense_gemm(t, rank, q_width)
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    norm = rowwise_ms(costs, "rmsnorm", batch, config.kv_lora_rank)
    return query + costs.dense_gemm(t, h, latent) + norm


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
    if batch.decode_context:  # the batch's share of the step's call ("Per-call floors")
        whole = costs.decode_attention(kind, batch.step_rows, batch.decode_context)
        return whole * batch.tokens / batch.step_rows * scale
    total = sum(
        costs.extend_attention(kind, [new + prefix]) - costs.extend_attention(kind, [prefix])
        for new, prefix in batch.chunks
    )
    return total * scale


def dense_mlp_ms(costs: step_costs.StepCosts, batch: Batch, hidden: int, width: int) -> float:
    """A SwiGLU MLP of ``width`` over the batch's rows: gate/up, ``silu * up``, down."""
    t = batch.tokens
    gate_up = costs.dense_gemm(t, hidden, 2 * width) + rowwise_ms(costs, "add", batch, 2 * width)
    return gate_up + costs.dense_gemm(t, width, hidden)


def moe_costs(
    costs: step_costs.StepCosts,
    config: config_lib.MoEConfig,
    batch: Batch,
    routing: step_exchange.Routing,
    gemm: ExpertGemm = ExpertGemm(),
) -> dict[str, float]:
    """``gate`` .. ``output`` compute of a MoE layer, ms (``gemm``: the experts' pricing)."""
    t, h, k = batch.tokens, config.hidden_size, config.num_experts_per_tok
    sent = 1 + routing.remote_gpus_per_token if routing.ep_size > 1 else 1.0  # rows per token
    pairs = t * k * routing.imbalance
    return dict(
        gate=costs.dense_gemm(t, h, config.num_experts),
        select_experts=rowwise_ms(costs, "routing", batch, config.num_experts),
        dispatch_a=rowwise_ms(costs, "gather", batch, h, sent),
        dispatch_b=rowwise_ms(costs, "gather", batch, h, sent * routing.imbalance),
        experts=experts_ms(costs, config, pairs, routing.local_experts, gemm),
        combine_a=rowwise_ms(costs, "gather", batch, h, k * routing.imbalance),
        shared_experts=dense_mlp_ms(costs, batch, h, config.shared_width)
        if config.shared_width
        else 0.0,
        combine_b=rowwise_ms(costs, "gather", batch, h, sent),
        output=rowwise_ms(costs, "add", batch, h),
        comm_postprocess_layer=0.0,
    )
