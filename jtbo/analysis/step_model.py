"""A TBO step model: the plain and the TBO step time of a MoE model at any EP size and link.

From what one GPU can measure (the per-operation cost table, ``step_costs``), the model
predicts what a step takes on one GPU of an EP group of any size, with and without two-batch
overlap:

1. **Operations.** The step is the operation list jtbo runs (``jtbo.models.step_operations``):
   the embedding and the leading dense layers in the dense layout, every MoE layer in the
   strategy's layout of the mode (``jtbo.overlap.strategy.layer_layout``, yields included),
   the final norm; the LM head runs on each prompt's last row after the micro-batches merge
   (prefill) or on every row inside the epilogue (decode). Each operation's compute is priced
   for its micro-batch's rows (``step_ops``).
2. **Exchanges.** ``dispatch_a`` and ``combine_a`` start an exchange of the dedup dispatch's
   bytes over the GPU's link (``step_exchange.Link``: GB/s per GPU and a fixed latency per
   exchange); ``dispatch_b`` and ``combine_b`` wait for it.
3. **Schedule.** A plain step runs the whole batch through the list in order; a TBO step
   splits it into two micro-batches (the prompts cut at the middle token, the decode
   sequences halved) and runs them staggered by the layout's ``delta`` stages, one compute
   stream and one link shared by both (``step_schedule``), compute beside an exchange slowed by
   the table's measured factor for the link's engine. At EP size 1 there is nothing to
   exchange and jtbo runs the micro-batches in lockstep (``overlap.operations``): operation by
   operation, A's then B's, the joint operations once over both micro-batches' rows and the
   row-wise ones too where the micro-batches are small (``lockstep_order``). A decode TBO
   step also pays the merge of its micro-batches' logits (a prefill step reads each prompt's
   last row either way).
   Both add one host time per step (``StepInputs.host_ms``; None: the table's, the runner's
   measured host phases of the mode's plain or TBO step where it has them).

The **serving stack** is an input (``StepInputs.exchange``, ``StepInputs.decode_attention``,
``StepInputs.expert_gemm`` and the link's engine; ``serving_stack`` names two): ``jtbo``, the
default, prices jtbo's own stack (bf16 rows to each destination GPU, the table's attention
kernels and bf16 expert GEMMs, exchanges moved by kernels); ``sglang`` prices SGLang's
serving of DeepSeek-V3 over DeepEP: FP8 dispatch and bf16 combine rows; prefill on DeepEP's
normal kernels (one copy per destination node over the inter-node link, forwarded over NVLink
inside it; kernels on the GPU's SMs), decode on its low-latency kernels (one message per
(token, expert) pair, sent directly; the transfer in flight holds no SMs, so no compute
slowdown); decode attention at the memory roofline of a memory-bound MLA kernel; FP8
routed-expert GEMMs (DeepGEMM) at ``FP8_OVER_BF16_RATE``
(``step_ops.ExpertGemm``). Its stated rates and their sources: docs/benchmarks/, "TBO step
model priced for SGLang's stack" and "FP8 expert GEMMs".

The hottest GPU sets the step's pace: expert rows and received bytes scale with
``imbalance`` (1.0 by default: the balanced load an expert-placement balancer aims for; a
routing statistics file gives a measured one, ``imbalance_from_stats``).

Nothing is fitted to a result: every number comes from the table, the model's shapes, the
link and the schedule. ``gain`` is the throughput gain ``plain / tbo - 1`` (SGLang's measure),
``saving`` the time saved ``1 - tbo / plain``.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence

from jtbo.analysis import step_costs, step_exchange, step_ops, step_schedule
from jtbo.models import config as config_lib
from jtbo.models import step as step_lib
from jtbo.models import step_operations
from jtbo.overlap import strategy
from jtbo.split import forward_mode as forward_mode_lib

YIELD = strategy.YIELD
STACKS = ("jtbo", "sglang")
SGLANG_GPUS_PER_NODE = 8
"""GPUs per node of SGLang's deployment (one NVLink domain each)."""
SGLANG_NVLINK_GBPS = 370.0
"""GB/s a GPU sends over NVLink: jtbo's NCCL exchange between two H200s (BENCHMARKS.md, "TBO
step model: validation", link rates); the same NVLink generation as the H100's."""
FLASHMLA_GBPS = 3000.0
"""GB/s FlashMLA reads the KV cache at in its memory-bound decode (its published figure)."""
FP8_OVER_BF16_RATE = 2.0
"""The SGLang stack's FP8 expert GEMMs (DeepGEMM) over bf16 ones at compute-bound sizes:
Hopper's FP8 tensor-core rate over its bf16 rate (NVIDIA's published peaks), the rate
DeepGEMM's published FP8 figure comes close to (docs/benchmarks/, "FP8 expert GEMMs")."""
MODES = {
    "prefill": forward_mode_lib.ForwardMode.EXTEND,
    "decode": forward_mode_lib.ForwardMode.DECODE,
}
FLOAT32_WIDTH = 2
"""A float32 value's bytes in bf16 values (row-wise costs are priced by bf16 values moved)."""
ISSUES = {"dispatch_a": "dispatch", "combine_a": "combine"}
WAITS = {"dispatch_b": "dispatch", "combine_b": "combine"}
JOINT_OPERATIONS = frozenset({"experts", "select_experts"})
"""Operations with a joint form (``overlap.operations.JointOperation``): in lockstep, one call
over both micro-batches' rows."""
ROW_WISE_OPERATIONS = frozenset({
    "embed", "comm_prepare_attn", "attn_prepare", "comm_prepare_mlp", "mlp", "gate", "output",
    "shared_experts", "final_norm", "logits",
})  # fmt: skip
"""Operations marked row-wise (``overlap.row_joint.RowWiseOperation``): in lockstep, one call
over both micro-batches' rows where they hold at most ``step.SINGLE_DEVICE_MERGE_MAX_ROWS``."""


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What a prediction is made for."""

    ep_size: int  # GPUs in the EP group (DP attention: one DP rank per GPU)
    mode: str  # "prefill" or "decode"
    tokens_per_gpu: int  # token rows per GPU and step
    link: step_exchange.Link  # the EP exchange's link
    prompt_len: int = 4096  # prefill: tokens per prompt (the last one may be shorter)
    context: int = 2048  # decode: each sequence's context length
    imbalance: float = 1.0  # the hottest GPU's expert load over the mean
    exchange: step_exchange.Exchange = (
        step_exchange.Exchange()
    )  # rows' dtypes and topology (jtbo's)
    decode_attention: step_ops.DecodeAttention = step_ops.DecodeAttention()  # the kernel's price
    host_ms: float | None = None  # the host's time per step (None: the table's per mode)
    expert_gemm: step_ops.ExpertGemm = step_ops.ExpertGemm()  # routed experts: bf16 or FP8

    def __post_init__(self):
        """Checks the host time.

        Raises:
          ValueError: a negative host time.
        """
        if self.host_ms is not None and self.host_ms < 0:
            raise ValueError(f"host_ms must be >= 0, got {self.host_ms}")


@dataclasses.dataclass(frozen=True)
class Stack:
    """What a serving stack runs in one mode: the step model's inputs that describe it."""

    exchange: step_exchange.Exchange  # the EP exchange's rows and topology
    decode_attention: step_ops.DecodeAttention  # how decode attention is priced
    engine: str  # what moves the exchange's bytes: "sm" or "copy" (``step_exchange.Link.engine``)
    expert_gemm: step_ops.ExpertGemm = step_ops.ExpertGemm()  # the routed experts' pricing


def serving_stack(name: str, mode: str) -> Stack:
    """The named serving stack in ``mode`` (module docstring, "serving stack").

    Args:
      name: one of ``STACKS``.
      mode: "prefill" or "decode".

    Returns:
      The stack.

    Raises:
      ValueError: an unknown stack or mode.
    """
    if name not in STACKS or mode not in MODES:
        raise ValueError(f"stack {name!r} (one of {STACKS}), mode {mode!r} (prefill or decode)")
    if name == "jtbo":
        return Stack(step_exchange.Exchange(), step_ops.DecodeAttention(), "sm")
    topology, engine = ("node", "sm") if mode == "prefill" else ("pairs", "copy")
    exchange = step_exchange.Exchange(
        "fp8", "bf16", topology, SGLANG_GPUS_PER_NODE, SGLANG_NVLINK_GBPS
    )
    attention = step_ops.DecodeAttention("roofline", FLASHMLA_GBPS)
    return Stack(exchange, attention, engine, step_ops.ExpertGemm("fp8", FP8_OVER_BF16_RATE))


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """The predicted plain and TBO step on the hottest GPU."""

    plain_ms: float  # plain step
    tbo_ms: float  # TBO step
    per_operation: dict[str, dict[str, float]]  # name -> {"plain_ms", "tbo_ms"} of compute
    exchange_ms: float  # link time of the step's exchanges (the same bytes either way)
    waited_ms: dict[str, float]  # {"plain", "tbo"}: compute stream waiting for exchanges
    remote_gpus_per_token: float  # the dedup dispatch's expected destinations per token
    slowdown: float  # compute slowdown beside an exchange, as used
    traffic: dict[str, float]  # {"link_bytes", "nvlink_bytes"} the hottest GPU sends per step

    @property
    def gain(self) -> float:
        """Throughput gain of TBO, ``plain / tbo - 1`` (negative: TBO loses)."""
        return self.plain_ms / self.tbo_ms - 1

    @property
    def saving(self) -> float:
        """Time TBO saves, ``1 - tbo / plain``."""
        return 1 - self.tbo_ms / self.plain_ms

    def as_json(self) -> dict:
        """The prediction as a JSON-ready dict (``gain`` and ``saving`` included)."""
        return dict(dataclasses.asdict(self), gain=self.gain, saving=self.saving)


def prefill_batch(tokens: int, prompt_len: int) -> step_ops.Batch:
    """``tokens`` fresh rows as prompts of ``prompt_len`` (the last one holds the rest)."""
    full, rest = divmod(tokens, prompt_len)
    chunks = ((prompt_len, 0),) * full + (((rest, 0),) if rest else ())
    return step_ops.Batch(tokens, chunks)


def split_batch(batch: step_ops.Batch) -> tuple[step_ops.Batch, step_ops.Batch]:
    """TBO's two micro-batches: the rows cut at the middle token (a prompt across the cut
    becomes two chunks, the second with the first as its prefix), decode sequences halved;
    each knows the whole step's rows (``Batch.step_tokens``)."""
    half, whole = batch.tokens / 2, batch.tokens
    if batch.decode_context:
        return (dataclasses.replace(batch, tokens=half, step_tokens=whole),) * 2
    first, second, seen = [], [], 0
    for new, prefix in batch.chunks:
        cut = min(max(half - seen, 0), new)
        if cut:
            first.append((int(cut), prefix))
        if new - cut:
            second.append((int(new - cut), prefix + int(cut)))
        seen += new
    return (
        step_ops.Batch(half, tuple(first), step_tokens=whole),
        step_ops.Batch(whole - half, tuple(second), step_tokens=whole),
    )


def _family(config: config_lib.MoEConfig) -> strategy.LayerFamily:
    return step_operations.layer_family(config)


def _layer_names(config: config_lib.MoEConfig, mode: str) -> list[list[str]]:
    """Every layer's operation names with yields, in step order (the dense layout for dense
    layers), the embedding first and the epilogue last."""
    moe_layout, _ = strategy.layer_layout(_family(config), MODES[mode])
    layers = [
        list(moe_layout if is_moe else step_operations.DENSE_LAYOUT)
        for is_moe in config.is_moe_layer
    ]
    layers[0] = ["embed", *layers[0]]
    two_stage = (_family(config), mode) in step_operations._TWO_STAGE_EPILOGUE
    tail = ["final_norm"] + (
        [YIELD, "logits"] if two_stage else ["logits"] if mode == "decode" else []
    )
    return [*layers, tail]


def _layer_costs(
    costs: step_costs.StepCosts, config, inputs: StepInputs, batch: step_ops.Batch, routing,
    is_moe: bool,
) -> dict[str, float]:  # fmt: skip
    t, h = batch.tokens, config.hidden_size
    out = step_ops.attention_costs(costs, config, batch, inputs.decode_attention)
    out.update(step_ops.moe_costs(costs, config, batch, routing, inputs.expert_gemm))
    out["mlp"] = 0.0 if is_moe else step_ops.dense_mlp_ms(costs, batch, h, config.intermediate_size)
    out["comm_postprocess_layer"] = 0.0
    out["embed"] = step_ops.rowwise_ms(costs, "gather", batch, h)
    out["final_norm"] = step_ops.rowwise_ms(costs, "rmsnorm", batch, h)
    out["logits"] = costs.dense_gemm(t, h, config.vocab_size)
    return out


def micro_batch_stages(
    costs: step_costs.StepCosts,
    config: config_lib.MoEConfig,
    inputs: StepInputs,
    batch: step_ops.Batch,
    label: str,
) -> list[list[step_schedule.Op]]:
    """One micro-batch's whole step as stages of priced operations (exchange keys start with
    ``label``)."""
    routing = step_exchange.routing_for(config, inputs.ep_size, inputs.imbalance)
    sent = step_exchange.exchange_bytes(config, batch.tokens, routing, inputs.exchange)
    link_ms = {
        name: step_exchange.exchange_ms(inputs.link, inputs.exchange, traffic)
        for name, traffic in sent.items()
    }
    stages, current = [], []
    for index, names in enumerate(_layer_names(config, inputs.mode)):
        is_moe = index < config.num_layers and config.is_moe_layer[index]
        priced = _layer_costs(costs, config, inputs, batch, routing, is_moe)
        for name in names:
            if name == YIELD:
                stages, current = stages + [current], []
                continue
            key = f"{label}.L{index}.{ISSUES.get(name) or WAITS.get(name, '')}"
            exchange = link_ms[ISSUES[name]] if name in ISSUES else 0.0
            current.append(
                step_schedule.Op(
                    name, priced[name], key if name in ISSUES else None,
                    key if name in WAITS else None, exchange,
                )
            )  # fmt: skip
    return stages + ([current] if current else [])


def lockstep_order(
    whole: Sequence[step_schedule.Stage],
    halves: Sequence[Sequence[step_schedule.Stage]],
    child_rows: int,
) -> list[step_schedule.Op]:
    """A one-GPU TBO step's operations in the lockstep executor's order.

    Args:
      whole: the plain step's stages (the whole batch's operations).
      halves: micro-batch A's and B's stages (the same operations).
      child_rows: rows per micro-batch.

    Returns:
      Every operation of A then the same of B, except that a joint operation (and a row-wise
      one when ``child_rows`` is at most ``step.SINGLE_DEVICE_MERGE_MAX_ROWS``) appears once,
      priced as the whole batch's.

    Raises:
      ValueError: the three lists do not hold the same operations.
    """
    joined = JOINT_OPERATIONS
    if child_rows <= step_lib.SINGLE_DEVICE_MERGE_MAX_ROWS:
        joined = joined | ROW_WISE_OPERATIONS
    flat = [[op for stage in stages for op in stage] for stages in (whole, *halves)]
    if len({tuple(op.name for op in ops) for ops in flat}) != 1:
        raise ValueError("lockstep needs the same operations in the step and both halves")
    order = []
    for plain_op, op_a, op_b in zip(*flat, strict=True):
        order += [plain_op] if plain_op.name in joined else [op_a, op_b]
    return order


def _batch(inputs: StepInputs) -> step_ops.Batch:
    if inputs.mode == "decode":
        return step_ops.Batch(inputs.tokens_per_gpu, decode_context=inputs.context)
    return prefill_batch(inputs.tokens_per_gpu, inputs.prompt_len)


def _after_merge(costs, config, inputs: StepInputs, tbo: bool) -> list[step_schedule.Op]:
    """Work after both micro-batches. Prefill: each prompt's last row read out (the plain
    step gathers it, the TBO step takes it from the two micro-batches' outputs without merging
    them), then the LM head on those rows. Decode: for TBO, the merge of the micro-batches'
    float32 logits rows (the LM head ran inside each)."""
    h, ops = config.hidden_size, []
    if inputs.mode == "prefill":
        prompts = math.ceil(inputs.tokens_per_gpu / inputs.prompt_len)
        ops.append(step_schedule.Op("last_rows", costs.rowwise("gather", prompts, h)))
        ops.append(step_schedule.Op("logits", costs.dense_gemm(prompts, h, config.vocab_size)))
    elif tbo:
        merged = costs.rowwise("gather", inputs.tokens_per_gpu, FLOAT32_WIDTH * config.vocab_size)
        ops.append(step_schedule.Op("tbo_merge", merged))
    return ops


def _per_operation(plain: step_schedule.Timeline, tbo: step_schedule.Timeline) -> dict:
    names = sorted(set(plain.compute_ms) | set(tbo.compute_ms))
    return {
        name: dict(plain_ms=plain.compute_ms.get(name, 0.0), tbo_ms=tbo.compute_ms.get(name, 0.0))
        for name in names
    }


def predict(
    config: config_lib.MoEConfig,
    inputs: StepInputs,
    costs: step_costs.StepCosts | None = None,
    slowdown: float | None = None,
) -> StepPrediction:
    """Predicts the plain and the TBO step of ``config`` (module docstring).

    Args:
      config: the model.
      inputs: EP size, mode, tokens per GPU, link, prompt / context length, imbalance.
      costs: the cost table; None: the shipped H200 table.
      slowdown: compute slowdown beside an exchange; None: the table's for the link's engine.

    Returns:
      The prediction.

    Raises:
      ValueError: an unknown mode, or no tokens.
    """
    if inputs.mode not in MODES or inputs.tokens_per_gpu < 1:
        raise ValueError(
            f"mode {inputs.mode!r} (prefill or decode), tokens {inputs.tokens_per_gpu}"
        )
    costs = costs or step_costs.load()
    slowdown = costs.slowdown(inputs.link.engine) if slowdown is None else slowdown
    _, delta = strategy.layer_layout(_family(config), MODES[inputs.mode])
    whole = _batch(inputs)
    plain_order = micro_batch_stages(costs, config, inputs, whole, "plain")
    plain_order.append(_after_merge(costs, config, inputs, tbo=False))
    halves = [
        micro_batch_stages(costs, config, inputs, b, n)
        for b, n in zip(split_batch(whole), "AB", strict=True)
    ]
    if inputs.ep_size == 1:
        child_rows = math.ceil(whole.tokens / 2)
        tbo_order = [lockstep_order(plain_order[:-1], halves, child_rows)]
    else:
        tbo_order = list(step_schedule.rounds(*halves, delta))
    tbo_order.append(_after_merge(costs, config, inputs, tbo=True))
    plain = step_schedule.simulate(plain_order, slowdown)
    tbo = step_schedule.simulate(tbo_order, slowdown)
    routing = step_exchange.routing_for(config, inputs.ep_size, inputs.imbalance)
    host = [
        costs.step_host_ms(inputs.mode, on) if inputs.host_ms is None else inputs.host_ms
        for on in (False, True)
    ]
    return StepPrediction(
        plain_ms=plain.total_ms + host[0],
        tbo_ms=tbo.total_ms + host[1],
        per_operation=_per_operation(plain, tbo),
        exchange_ms=plain.exchange_ms,
        waited_ms=dict(plain=plain.waited_ms, tbo=tbo.waited_ms),
        remote_gpus_per_token=routing.remote_gpus_per_token,
        slowdown=slowdown,
        traffic=step_traffic(config, inputs, whole, routing),
    )


def step_traffic(
    config: config_lib.MoEConfig,
    inputs: StepInputs,
    batch: step_ops.Batch,
    routing: step_exchange.Routing,
) -> dict[str, float]:
    """Bytes the hottest GPU sends in one step over the link and over NVLink (every MoE
    layer's dispatch and combine; the same for the plain and the TBO step)."""
    sent = step_exchange.exchange_bytes(config, batch.tokens, routing, inputs.exchange).values()
    layers = sum(config.is_moe_layer)
    return dict(
        link_bytes=layers * sum(t.link_bytes for t in sent),
        nvlink_bytes=layers * sum(t.nvlink_bytes for t in sent),
    )


def imbalance_from_stats(
    stats_path, config: config_lib.MoEConfig, ep_size: int, tokens: int
) -> float:
    """The expert-load imbalance a routing statistics file measured (``ep_stats_file``): the
    busiest expert's peak over its balanced load, at the recorded dispatch size nearest
    ``tokens`` rows per GPU (at least 1.0).

    Raises:
      ValueError: the file fails ``ep_stats_file.load`` for this model and EP size.
    """
    from jtbo.runner import ep_stats_file  # noqa: PLC0415  (only for a stats file)

    model = dict(num_experts=config.num_experts, top_k=config.num_experts_per_tok, ep_size=ep_size)
    peaks = ep_stats_file.load(stats_path, dict(model, dedup=False))
    rows = min(peaks, key=lambda r: abs(math.log(r / tokens)))
    balanced = rows * ep_size * config.num_experts_per_tok / config.num_experts
    return max(1.0, peaks[rows][1] / balanced)


def auto_predictor(
    config: config_lib.MoEConfig,
    ep_size: int,
    link: step_exchange.Link,
    costs: step_costs.StepCosts | None = None,
    prompt_len: int = 4096,
    context: int = 2048,
) -> Callable:
    """A ``TboOptions(tbo_predictor=...)`` for ``tbo_auto_source="model"``: maps a step shape
    (its ``capacity`` rows per DP rank and its mode) to predicted ``(plain_ms, tbo_ms)``.

    Args:
      config: the served model.
      ep_size: GPUs in its EP group.
      link: the EP exchange's link.
      costs: the cost table; None: the shipped one.
      prompt_len: prefill prompt length assumed.
      context: decode context length assumed.

    Returns:
      ``predictor(shape) -> (plain_ms, tbo_ms)``.
    """
    costs = costs or step_costs.load()

    def predictor(shape) -> tuple[float, float]:
        mode = (
            "decode" if shape.mode.is_decode() or shape.mode.name == "TARGET_VERIFY" else "prefill"
        )
        inputs = StepInputs(ep_size, mode, shape.capacity, link, prompt_len, context)
        made = predict(config, inputs, costs)
        return made.plain_ms, made.tbo_ms

    return predictor


def sweep(
    config: config_lib.MoEConfig,
    base: StepInputs,
    ep_sizes: Sequence[int],
    tokens: Sequence[int],
    costs: step_costs.StepCosts | None = None,
) -> dict[int, list[float]]:
    """Predicted gain per EP size at each tokens-per-GPU count (the ``--plot`` curves)."""
    costs = costs or step_costs.load()
    return {
        ep: [
            predict(config, dataclasses.replace(base, ep_size=ep, tokens_per_gpu=t), costs).gain
            for t in tokens
        ]
        for ep in ep_sizes
    }
