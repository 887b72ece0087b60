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

Exchange bytes follow jtbo's dedup dispatch: a token sends its hidden row once to each other
GPU holding one of its experts (``remote_gpus_per_token``), with its expert ids and weights;
the combine sends one bf16 partial sum back per such row. The hottest GPU's rows and received
bytes are the balanced ones times ``imbalance``.
"""

import dataclasses
import math

from jtbo.analysis import step_costs
from jtbo.models import config as config_lib

BF16 = 2
ROUTE_BYTES = 8  # per (token, expert) in a dispatched row: an int32 id and a float32 weight


@dataclasses.dataclass(frozen=True)
class Batch:
    """One (micro-)batch's work on one GPU."""

    tokens: float  # token rows on this GPU
    chunks: tuple[tuple[int, int], ...] = ()  # extend: (new tokens, cached prefix) per prompt
    decode_context: int = 0  # decode: context length of each sequence (tokens = sequences)


@dataclasses.dataclass(frozen=True)
class Link:
    """The EP exchange's link, per GPU."""

    gbps: float  # bytes a GPU sends per second, in GB/s (inf: exchanges take no time)
    latency_us: float = 0.0  # fixed time of every exchange, microseconds
    engine: str = "sm"  # what moves the bytes: "sm" (kernels) or "copy" (copy engines)

    def exchange_ms(self, num_bytes: float) -> float:
        """Milliseconds of one exchange sending ``num_bytes`` (0 when nothing is sent)."""
        if num_bytes <= 0:
            return 0.0
        return num_bytes / (self.gbps * 1e9) * 1e3 + self.latency_us / 1e3


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where a MoE layer's tokens go at one EP size."""

    ep_size: int  # GPUs the experts are spread over
    local_experts: int  # experts per GPU (ceil(num_experts / ep): replicas fill the rest)
    remote_gpus_per_token: float  # expected other GPUs one token's row goes to
    imbalance: float = 1.0  # the hottest GPU's load over the mean (>= 1)


def _comb_ratio(total: int, removed: int, k: int) -> float:
    """``C(total - removed, k) / C(total, k)``: no pick of ``k`` lands in ``removed``."""
    if k > total - removed:
        return 0.0
    return math.prod((total - removed - i) / (total - i) for i in range(k))


def gpu_hit_probability(config: config_lib.MoEConfig, ep_size: int, local: int) -> float:
    """Probability that a token has at least one of its top-k experts on a given GPU.

    Experts are uniform within the token's ``topk_group`` groups (all experts when the
    routing has one group): where a group spans whole GPUs, the GPU must be in a chosen group
    and get one of the ``k`` picks among the chosen groups' experts; where a GPU holds whole
    groups, it must hold a chosen group.
    """
    slots, k = ep_size * local, config.num_experts_per_tok
    groups, chosen = config.n_group, config.topk_group
    group_size = slots // groups if slots % groups == 0 else 0
    if groups > 1 and chosen < groups and group_size and group_size % local == 0:
        candidates = chosen * group_size
        return chosen / groups * (1 - _comb_ratio(candidates, local, k))
    if groups > 1 and chosen < groups and group_size and local % group_size == 0:
        return 1 - _comb_ratio(groups, local // group_size, chosen)
    return 1 - _comb_ratio(slots, local, k)


def routing_for(config: config_lib.MoEConfig, ep_size: int, imbalance: float = 1.0) -> Routing:
    """The ``Routing`` of ``config``'s experts over ``ep_size`` GPUs.

    Raises:
      ValueError: ``ep_size < 1`` or ``imbalance < 1``.
    """
    if ep_size < 1 or imbalance < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1 and imbalance={imbalance} >= 1")
    local = math.ceil(config.num_experts / ep_size)
    remote = (ep_size - 1) * gpu_hit_probability(config, ep_size, local)
    return Routing(ep_size, local, remote, imbalance)


def attention_costs(costs: step_costs.StepCosts, config: config_lib.MoEConfig, batch: Batch):
    """``comm_prepare_attn`` .. ``comm_prepare_mlp`` compute, ms."""
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
        attn_core=_attention_core(costs, config, batch),
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


def _attention_core(costs: step_costs.StepCosts, config: config_lib.MoEConfig, batch: Batch):
    kind = config.attention_kind
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
    costs: step_costs.StepCosts, config: config_lib.MoEConfig, batch: Batch, routing: Routing
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


def exchange_bytes(
    config: config_lib.MoEConfig, batch: Batch, routing: Routing
) -> dict[str, float]:
    """Bytes the hottest GPU moves per exchange: ``{"dispatch": ..., "combine": ...}``."""
    rows = batch.tokens * routing.remote_gpus_per_token * routing.imbalance
    row = config.hidden_size * BF16
    return dict(
        dispatch=rows * (row + ROUTE_BYTES * config.num_experts_per_tok), combine=rows * row
    )
