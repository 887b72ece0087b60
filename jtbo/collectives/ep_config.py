"""Static configuration of one expert-parallel dispatcher, and its capacity rule.

The expert-parallel (EP) group is every device of the mesh (``TP_AXES``: all of ``dp`` x
``attn_tp``), in tp_rank order; expert ``e`` lives on device ``e // num_local_experts``.
Shapes must be static under jit, so the exchange uses fixed slot counts:

* ``peer_capacity``: slots a device reserves for its rows to one destination device (the
  dense all-to-all moves ``ep_size * peer_capacity`` rows each way). A row is one (token,
  expert) assignment, or with ``dedup`` one (token, destination device) pair: the token once,
  with its local expert ids and weights (``jtbo.collectives.ep_dedup``);
* ``expert_capacity``: slots per local expert in the ``[num_local_experts, slots, hidden]``
  layout the batched expert einsum consumes.

Measured capacities (``sized_from_peaks``): ``headroom`` times the peak loads a runner
recorded for dispatches of the same size (its saved routing statistics). Otherwise, default
capacities (``create_ep_dispatcher``): ``capacity_factor`` times the balanced load
(``tokens * top_k / ep_size`` per peer, ``tokens * top_k / num_local_experts`` per expert),
rounded up to ``slot_alignment`` and never above the worst case (``tokens * min(top_k,
num_local_experts)`` per peer: a token's experts are distinct; ``tokens * ep_size`` per expert,
also bounded by everything the peers can send). With ``dedup`` the balanced load per peer is
the expected number of tokens that hit the peer under uniform routing,
``tokens * (1 - C(E - E / ep, top_k) / C(E, top_k))`` (the chance that at least one of a
token's ``top_k`` distinct experts is among the peer's ``E / ep``; summed over the peers this
is ``expected_ranks_per_token``), and the worst case is ``tokens``. ``worst_case=True`` takes
the worst case: it can never overflow. An assignment that does not fit is counted in the
step's overflow, never dropped silently (``jtbo.collectives.ep_overflow`` says what the host
does then).

A dispatcher is a frozen, hashable config: each TBO micro-batch builds its own (its token count
is that micro-batch's capacity), like SGLang's ``MaybeTboDeepEPDispatcher`` holds one inner
dispatcher per micro-batch.
"""

import dataclasses
import math

import jax

from jtbo.collectives import mesh as mesh_lib
from jtbo.collectives import peer_copy
from jtbo.core import arith

EXCHANGES = ("dense", "ragged", "peer_copy")


@dataclasses.dataclass(frozen=True)
class EpDispatcher:
    """Static description of one micro-batch's EP dispatch/combine.

    Attributes:
      num_experts: routed experts in the model.
      ep_size: devices in the EP group (experts are split evenly over them).
      num_tokens: token rows per device given to ``dispatch_a``.
      top_k: experts per token.
      peer_capacity: slots per (source device, destination device) pair.
      expert_capacity: slots per local expert in the expert-input layout.
      exchange: "dense" (``lax.all_to_all`` of fixed slots; overlappable, runs anywhere),
        "ragged" (``lax.ragged_all_to_all`` of the filled slots only; GPU only) or
        "peer_copy" (the fixed slots by copy-engine transfers on a side stream,
        ``jtbo.collectives.peer_copy``; one process, CPU or CUDA devices).
      platform: platform the mesh compiles for ("cpu", "gpu", ...).
      axis_names: mesh axes forming the EP group, major first.
      dedup: send each token once per destination device that holds any of its experts,
        with its local expert ids and weights (``jtbo.collectives.ep_dedup``), instead of once
        per (token, expert) assignment; ``peer_capacity`` then counts (token, device) rows.
      device_group: for "peer_copy", the local device ordinals of the EP group in EP rank
        order (``peer_copy.device_group``); empty for the other exchanges.
    """

    num_experts: int
    ep_size: int
    num_tokens: int
    top_k: int
    peer_capacity: int
    expert_capacity: int
    exchange: str = "dense"
    platform: str = "gpu"
    axis_names: tuple[str, ...] = mesh_lib.TP_AXES
    dedup: bool = False
    device_group: tuple[int, ...] = ()  # "peer_copy": local ordinals of the EP group's devices

    def __post_init__(self):
        if self.num_experts < 1 or self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={self.num_experts} must be a positive multiple of "
                f"ep_size={self.ep_size}"
            )
        for name in ("num_tokens", "top_k", "peer_capacity", "expert_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange={self.exchange!r} must be one of {EXCHANGES}")
        if self.exchange == "ragged" and self.platform != "gpu":
            raise ValueError(
                f"exchange='ragged' needs a GPU mesh: jax.lax.ragged_all_to_all has no lowering "
                f"for platform={self.platform!r} (XLA:CPU lacks it); use exchange='dense'"
            )
        if (self.exchange == "peer_copy") != (len(self.device_group) == self.ep_size):
            raise ValueError(
                f"exchange={self.exchange!r} with device_group={self.device_group}: the "
                f"peer-copy exchange needs the {self.ep_size} devices' ordinals, the others none"
            )

    @property
    def num_local_experts(self) -> int:
        """Experts on each device."""
        return self.num_experts // self.ep_size

    @property
    def local_ids_per_row(self) -> int:
        """Experts one token can have on one device: ``min(top_k, num_local_experts)``."""
        return min(self.top_k, self.num_local_experts)

    @property
    def worst_peer_capacity(self) -> int:
        """Slots per peer that can never overflow: every token sends each peer at most
        ``local_ids_per_row`` assignments, or one row with ``dedup``."""
        return self.num_tokens * (1 if self.dedup else self.local_ids_per_row)

    @property
    def worst_expert_capacity(self) -> int:
        """Slots per expert that can never overflow given ``peer_capacity``."""
        return min(self.num_tokens * self.ep_size, self.ep_size * self.peer_capacity)


def create_ep_dispatcher(
    mesh: jax.sharding.Mesh,
    *,
    num_experts: int,
    num_tokens: int,
    top_k: int,
    capacity_factor: float = 2.0,
    worst_case: bool = False,
    exchange: str = "dense",
    slot_alignment: int = 8,
    dedup: bool = False,
) -> EpDispatcher:
    """Builds a dispatcher over all axes of ``mesh`` with the stated capacity rule.

    Args:
      mesh: the ("dp", "attn_tp") mesh; every device is in the EP group.
      num_experts: routed experts (a multiple of the device count).
      num_tokens: token rows per device in one dispatch (the micro-batch's SCATTERED rows).
      top_k: experts per token.
      capacity_factor: multiple of the balanced load reserved per peer and per expert.
      worst_case: reserve the worst case instead (never overflows, largest buffers).
      exchange: "dense", "ragged" (GPU only) or "peer_copy" (one process).
      slot_alignment: capacities are rounded up to a multiple of this (GEMM-friendly).
      dedup: one row per (token, destination device) (``EpDispatcher.dedup``).

    Returns:
      The dispatcher.

    Raises:
      ValueError: bad sizes, a factor <= 0, a ragged exchange on a non-GPU mesh, or a
        peer-copy exchange over devices of several processes.
    """
    if capacity_factor <= 0 or slot_alignment < 1:
        raise ValueError(
            f"capacity_factor={capacity_factor} must be > 0 and slot_alignment="
            f"{slot_alignment} >= 1"
        )
    ep_size = mesh.devices.size
    worst = EpDispatcher(
        num_experts=num_experts,
        ep_size=ep_size,
        num_tokens=num_tokens,
        top_k=top_k,
        peer_capacity=1,
        expert_capacity=1,
        exchange=exchange,
        platform=mesh_lib.mesh_platform(mesh),
        axis_names=tuple(mesh.axis_names),
        dedup=dedup,
        device_group=peer_copy.device_group(mesh) if exchange == "peer_copy" else (),
    )
    if worst_case:
        peer = worst.worst_peer_capacity
        worst = dataclasses.replace(worst, peer_capacity=peer)
        return dataclasses.replace(worst, expert_capacity=worst.worst_expert_capacity)
    return _balanced_capacities(worst, capacity_factor, slot_alignment)


def _balanced_capacities(
    worst: EpDispatcher, capacity_factor: float, slot_alignment: int
) -> EpDispatcher:
    """``worst`` with ``capacity_factor`` times the balanced load per peer and per expert,
    rounded up to ``slot_alignment``, each at most its worst case."""
    num_tokens, top_k, ep_size = worst.num_tokens, worst.top_k, worst.ep_size
    balanced = num_tokens * top_k / ep_size
    if worst.dedup:
        balanced = (
            num_tokens * expected_ranks_per_token(worst.num_experts, ep_size, top_k) / ep_size
        )
    peer = min(
        worst.worst_peer_capacity, round_up(math.ceil(capacity_factor * balanced), slot_alignment)
    )
    worst = dataclasses.replace(worst, peer_capacity=peer)
    balanced = num_tokens * top_k / worst.num_local_experts
    expert = min(
        worst.worst_expert_capacity, round_up(math.ceil(capacity_factor * balanced), slot_alignment)
    )
    return dataclasses.replace(worst, expert_capacity=expert)


def sized_from_peaks(
    dispatcher: EpDispatcher,
    peer_peak: int,
    expert_peak: int,
    *,
    headroom: float,
    slot_alignment: int,
) -> EpDispatcher:
    """``dispatcher`` with capacities sized on measured peak loads instead of the factor rule.

    Each capacity becomes ``headroom`` times its measured peak (the most assignments, or
    dedup rows, one peer or one local expert was given in a dispatch of this size), rounded
    up to ``slot_alignment`` and never above the worst case. The expert capacity's worst case
    follows the new peer capacity.

    Args:
      dispatcher: the dispatcher to resize (its token count is the one the peaks were
        measured at).
      peer_peak: measured peak per (source, destination) peer.
      expert_peak: measured peak per local expert.
      headroom: multiple of the peak reserved (>= 1).
      slot_alignment: rounding (>= 1).

    Returns:
      The resized dispatcher.

    Raises:
      ValueError: a negative peak, ``headroom < 1`` or ``slot_alignment < 1``.
    """
    if peer_peak < 0 or expert_peak < 0 or headroom < 1 or slot_alignment < 1:
        raise ValueError(
            f"peer_peak={peer_peak}, expert_peak={expert_peak} must be >= 0, headroom="
            f"{headroom} >= 1 and slot_alignment={slot_alignment} >= 1"
        )
    peer = min(
        dispatcher.worst_peer_capacity,
        round_up(math.ceil(headroom * peer_peak), slot_alignment),
    )
    resized = dataclasses.replace(dispatcher, peer_capacity=peer)
    expert = min(
        resized.worst_expert_capacity,
        round_up(math.ceil(headroom * expert_peak), slot_alignment),
    )
    return dataclasses.replace(resized, expert_capacity=expert)


def expected_ranks_per_token(num_experts: int, ep_size: int, top_k: int) -> float:
    """Distinct devices a token's ``top_k`` distinct experts hit, expected under uniform routing.

    A device misses a token when all ``top_k`` experts fall among the other devices'
    ``num_experts - num_experts / ep_size``; by linearity the expectation is ``ep_size`` times
    the chance that it does not.

    Args:
      num_experts: routed experts (a multiple of ``ep_size``).
      ep_size: devices in the EP group.
      top_k: experts per token (at most ``num_experts``).

    Returns:
      ``ep_size * (1 - C(E - E / ep_size, top_k) / C(E, top_k))``, in ``[1, min(top_k, ep_size)]``.

    Raises:
      ValueError: sizes that do not fit (see ``EpDispatcher``).
    """
    if ep_size < 1 or num_experts < 1 or num_experts % ep_size or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"num_experts={num_experts}, ep_size={ep_size}, top_k={top_k}: expected "
            f"num_experts a positive multiple of ep_size and 1 <= top_k <= num_experts"
        )
    others = num_experts - num_experts // ep_size
    missed = math.comb(others, top_k) / math.comb(num_experts, top_k)
    return ep_size * (1 - missed)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (at least ``multiple``)."""
    return max(1, arith.ceil_div(value, multiple)) * multiple
