"""The step model's EP exchange: its link, rows, topologies and bytes per exchange.

**Exchanges** (``Exchange``) are described by the rows' dtypes and a topology; every byte count
is for the hottest GPU (the balanced count times ``imbalance``), per exchange:

* a dispatched row is the token's hidden row (``row_bytes``: bf16, or FP8 with a float32 scale
  per ``FP8_BLOCK`` values) with its routing (``ROUTE_BYTES`` per chosen expert); a combined
  row is a hidden row in the combine dtype;
* ``flat`` (jtbo's dedup dispatch): one row per other GPU holding one of the token's experts
  (``Routing.remote_gpus_per_token``), all over the link;
* ``node`` (a hierarchical dispatch): one row per other *node* holding one of the token's
  experts (``remote_nodes_per_token``) over the link, then, inside each destination node, the
  GPU that received it forwards it over NVLink to every other GPU there that holds one of the
  token's experts: over the GPUs of a node that is ``(n - 1) / n`` of the token's distinct
  destination GPUs for ``n`` GPUs per node; the combine runs the same rows back;
* ``pairs`` (a per-expert dispatch): one message per (token, chosen expert) on another GPU, a
  ``PAIR_HEADER_BYTES`` header instead of the routing; those on another node over the link,
  those on another GPU of the same node over NVLink; the combine sends one row back per pair.

The link and NVLink legs run at once, so an exchange takes the longer of the two plus the
link's fixed latency (``exchange_ms``). Distinct GPUs and nodes per token both come from the
chance that a block of consecutive expert slots (a GPU's, a node's) holds one of a token's
experts under its group-limited top-k: ``block_hit_probability`` for GPUs (with its
shortcuts), ``grouped_hit_probability`` for nodes (exact for the same routing, so a token
never reaches more nodes than GPUs).
"""

import dataclasses
import math

from jtbo.models import config as config_lib

BF16 = 2
ROUTE_BYTES = 8  # per (token, expert) in a dispatched row: an int32 id and a float32 weight
FP8_BLOCK = 128  # values of an FP8 row sharing one scale
SCALE_BYTES = 4  # one float32 scale
PAIR_HEADER_BYTES = 16  # per message of a ``pairs`` dispatch: the source row's index, padded
ROW_DTYPES = ("bf16", "fp8")
TOPOLOGIES = ("flat", "node", "pairs")


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
class Exchange:
    """How the EP exchange moves a MoE layer's rows (module docstring, "Exchanges"); the
    default is jtbo's: bf16 rows, ``flat``."""

    dispatch_dtype: str = "bf16"  # dispatched rows, one of ROW_DTYPES
    combine_dtype: str = "bf16"  # expert outputs sent back, one of ROW_DTYPES
    topology: str = "flat"  # one of TOPOLOGIES
    gpus_per_node: int | None = None  # node / pairs: GPUs sharing one NVLink domain
    nvlink_gbps: float | None = None  # node / pairs: GB/s a GPU sends over NVLink in its node

    def __post_init__(self):
        """Checks the fields.

        Raises:
          ValueError: an unknown dtype or topology, or node fields missing for ``node`` /
            ``pairs``, given for ``flat``, or not positive.
        """
        if {self.dispatch_dtype, self.combine_dtype} - set(ROW_DTYPES):
            raise ValueError(
                f"row dtypes {self.dispatch_dtype!r} / {self.combine_dtype!r}: one of {ROW_DTYPES}"
            )
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology {self.topology!r}: one of {TOPOLOGIES}")
        if self.topology == "flat":
            if (self.gpus_per_node, self.nvlink_gbps) != (None, None):
                raise ValueError("a flat exchange has no NVLink leg: no gpus_per_node, nvlink_gbps")
        elif not ((self.gpus_per_node or 0) >= 1 and (self.nvlink_gbps or 0) > 0):
            raise ValueError(
                f"a {self.topology} exchange needs gpus_per_node >= 1 and nvlink_gbps > 0, got "
                f"{self.gpus_per_node} and {self.nvlink_gbps}"
            )


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one exchange moves from the hottest GPU."""

    link_bytes: float  # over the EP link (flat: all of them; node / pairs: to other nodes)
    nvlink_bytes: float = 0.0  # over NVLink inside the GPU's node (node / pairs)


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


def _grouped(config: config_lib.MoEConfig, slots: int) -> bool:
    """Whether a token's experts are limited to ``topk_group`` of ``n_group`` groups of whole
    slots (else they are uniform over all slots)."""
    groups, chosen = config.n_group, config.topk_group
    return groups > 1 and chosen < groups and slots % groups == 0


def block_hit_probability(config: config_lib.MoEConfig, slots: int, block: int) -> float:
    """Probability that a token has at least one of its top-k experts in a given block of
    ``block`` consecutive expert slots out of ``slots`` (the distinct-GPU count's rule).

    Experts are uniform within the token's ``topk_group`` groups (all experts when the
    routing has one group): where a group spans whole blocks, the block must be in a chosen
    group and get one of the ``k`` picks among the chosen groups' experts; where a block holds
    whole groups, it must hold a chosen group (a shortcut that counts every chosen group as
    hit); where blocks straddle groups, the picks are taken as uniform over all slots.

    Args:
      config: the model (its top-k and groups).
      slots: expert slots over the EP group (GPUs x experts per GPU; replicas included).
      block: slots in the block, dividing ``slots``.

    Returns:
      The probability.
    """
    k, groups, chosen = config.num_experts_per_tok, config.n_group, config.topk_group
    if _grouped(config, slots):
        group_size = slots // groups
        if group_size % block == 0:
            candidates = chosen * group_size
            return chosen / groups * (1 - _comb_ratio(candidates, block, k))
        if block % group_size == 0:
            return 1 - _comb_ratio(groups, block // group_size, chosen)
    return 1 - _comb_ratio(slots, block, k)


def grouped_hit_probability(config: config_lib.MoEConfig, slots: int, block: int) -> float:
    """``block_hit_probability``'s routing for any block, without its shortcuts: the token's
    ``k`` picks uniform over the experts of its ``topk_group`` chosen groups, the mean over the
    blocks that tile the slots of the chance that a pick lands in the block.

    For a block overlapping ``r`` groups by ``o_1 .. o_r`` slots: the sum over the sets ``A``
    of those groups the token may choose (``|A| <= topk_group``) of
    ``C(n_group - r, topk_group - |A|) / C(n_group, topk_group)`` (the token chose exactly
    ``A`` of them) times ``1 - C(n - s_A, k) / C(n, k)``, where ``n`` counts the chosen
    groups' slots and ``s_A`` the block's slots in ``A``. Sets are tallied by size and
    ``s_A``.

    Args:
      config: the model (its top-k and groups).
      slots: expert slots over the EP group.
      block: slots in the block, dividing ``slots``.

    Returns:
      The probability.
    """
    k, groups, chosen = config.num_experts_per_tok, config.n_group, config.topk_group
    if not _grouped(config, slots):
        return 1 - _comb_ratio(slots, block, k)
    group_size = slots // groups
    candidates, total = chosen * group_size, 0.0
    for start in range(0, slots, block):
        first, last = start // group_size, (start + block - 1) // group_size
        overlaps = [
            min(start + block, (g + 1) * group_size) - max(start, g * group_size)
            for g in range(first, last + 1)
        ]
        for (picked, inside), count in _subset_sums(overlaps, chosen).items():
            others = math.comb(groups - len(overlaps), chosen - picked)
            miss = _comb_ratio(candidates, inside, k)
            total += count * others / math.comb(groups, chosen) * (1 - miss)
    return total / (slots // block)


def _subset_sums(sizes: list[int], most: int) -> dict[tuple[int, int], int]:
    """How many non-empty subsets of ``sizes`` of at most ``most`` items have each
    ``(items, sum)``."""
    tally = {(0, 0): 1}
    for size in sizes:
        for (items, total), count in list(tally.items()):
            if items < most:
                key = (items + 1, total + size)
                tally[key] = tally.get(key, 0) + count
    del tally[(0, 0)]
    return tally


def gpu_hit_probability(config: config_lib.MoEConfig, ep_size: int, local: int) -> float:
    """Probability that a token has at least one of its top-k experts on a given GPU of
    ``ep_size`` holding ``local`` expert slots each (``block_hit_probability``)."""
    return block_hit_probability(config, ep_size * local, local)


def node_shape(ep_size: int, gpus_per_node: int) -> tuple[int, int]:
    """``(GPUs per node, nodes)`` of an EP group (one node when it has fewer GPUs than a node).

    Raises:
      ValueError: the EP group is not a whole number of nodes.
    """
    per_node = min(gpus_per_node, ep_size)
    if ep_size % per_node:
        raise ValueError(f"ep_size={ep_size} is not a whole number of {gpus_per_node}-GPU nodes")
    return per_node, ep_size // per_node


def node_hit_probability(config: config_lib.MoEConfig, ep_size: int, gpus_per_node: int) -> float:
    """Probability that a token has at least one of its top-k experts on a given node:
    ``grouped_hit_probability`` of the node's expert slots (without ``block_hit_probability``'s
    shortcuts, which could count more nodes than GPUs).

    Raises:
      ValueError: the EP group is not a whole number of nodes.
    """
    per_node, _ = node_shape(ep_size, gpus_per_node)
    local = math.ceil(config.num_experts / ep_size)
    return grouped_hit_probability(config, ep_size * local, per_node * local)


def nodes_per_token(config: config_lib.MoEConfig, ep_size: int, gpus_per_node: int) -> float:
    """Expected distinct nodes holding a token's experts (its own node included).

    Raises:
      ValueError: the EP group is not a whole number of nodes.
    """
    _, nodes = node_shape(ep_size, gpus_per_node)
    return nodes * node_hit_probability(config, ep_size, gpus_per_node)


def remote_nodes_per_token(config: config_lib.MoEConfig, ep_size: int, gpus_per_node: int) -> float:
    """Expected other nodes holding one of a token's experts (every node is as likely).

    Raises:
      ValueError: the EP group is not a whole number of nodes.
    """
    _, nodes = node_shape(ep_size, gpus_per_node)
    return (nodes - 1) * node_hit_probability(config, ep_size, gpus_per_node)


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


def row_bytes(dtype: str, hidden: int) -> int:
    """Bytes of one hidden row in ``dtype``: bf16, or FP8 (a byte per value and a float32
    scale per ``FP8_BLOCK`` values).

    Raises:
      ValueError: an unknown dtype, or FP8 rows whose width is not a multiple of FP8_BLOCK.
    """
    if dtype == "bf16":
        return hidden * BF16
    if dtype == "fp8":
        if hidden % FP8_BLOCK:
            raise ValueError(f"FP8 rows of {hidden} values: not a multiple of {FP8_BLOCK}")
        return hidden + hidden // FP8_BLOCK * SCALE_BYTES
    raise ValueError(f"row dtype {dtype!r}: one of {ROW_DTYPES}")


def exchange_rows(
    config: config_lib.MoEConfig, tokens: float, routing: Routing, exchange: Exchange
) -> tuple[float, float]:
    """Rows (``pairs``: messages) the hottest GPU sends per exchange: ``(over the link, over
    NVLink)`` for ``tokens`` rows on the GPU (module docstring, "Exchanges").

    Raises:
      ValueError: a node or pairs exchange over an EP group that is not whole nodes.
    """
    ep, load = routing.ep_size, routing.imbalance
    if exchange.topology == "flat":
        return tokens * routing.remote_gpus_per_token * load, 0.0
    per_node, _ = node_shape(ep, exchange.gpus_per_node)
    if exchange.topology == "node":
        gpus = ep * gpu_hit_probability(config, ep, routing.local_experts)
        remote = remote_nodes_per_token(config, ep, exchange.gpus_per_node)
        return tokens * remote * load, tokens * gpus * (per_node - 1) / per_node * load
    pairs = tokens * config.num_experts_per_tok * load
    return pairs * (ep - per_node) / ep, pairs * (per_node - 1) / ep


def exchange_bytes(
    config: config_lib.MoEConfig,
    tokens: float,
    routing: Routing,
    exchange: Exchange = Exchange(),
) -> dict[str, Traffic]:
    """Bytes the hottest GPU moves per exchange for ``tokens`` rows on it:
    ``{"dispatch": Traffic, "combine": Traffic}``.

    Raises:
      ValueError: FP8 rows of a width FP8 cannot hold, or a node or pairs exchange over an EP
        group that is not whole nodes.
    """
    link, nvlink = exchange_rows(config, tokens, routing, exchange)
    h, k = config.hidden_size, config.num_experts_per_tok
    header = PAIR_HEADER_BYTES if exchange.topology == "pairs" else ROUTE_BYTES * k
    sent = row_bytes(exchange.dispatch_dtype, h) + header
    back = row_bytes(exchange.combine_dtype, h)
    return dict(
        dispatch=Traffic(link * sent, nvlink * sent), combine=Traffic(link * back, nvlink * back)
    )


def exchange_ms(link: Link, exchange: Exchange, traffic: Traffic) -> float:
    """Milliseconds of one exchange: the longer of its link and NVLink legs (they run at once)
    plus the link's fixed latency (0 when nothing is sent)."""
    if traffic.link_bytes + traffic.nvlink_bytes <= 0:
        return 0.0
    over_link = traffic.link_bytes / (link.gbps * 1e9) * 1e3
    nvlink_gbps = exchange.nvlink_gbps if exchange.nvlink_gbps is not None else math.inf
    over_nvlink = traffic.nvlink_bytes / (nvlink_gbps * 1e9) * 1e3
    return max(over_link, over_nvlink) + link.latency_us / 1e3
