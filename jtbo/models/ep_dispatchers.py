"""One EP dispatcher per micro-batch, and the host's answer to a step's overflow.

The model's expert-parallel MoE runs through ``jtbo.collectives``' dispatcher (capacity-slot
dense all-to-all, or the ragged exchange on GPU). A dispatcher is a frozen, hashable config
whose token count is what one device routes in one dispatch: the rows of its attn_tp shard of
the micro-batch (``capacity / attn_tp_size`` without TBO, ``child_capacity / attn_tp_size`` per
TBO child). So a plain step has one dispatcher and a TBO step two, one per micro-batch, like
SGLang's ``MaybeTboDeepEPDispatcher`` holds one inner dispatcher per micro-batch. Dispatchers
are static arguments of the jitted step: part of its compile key.

Capacities come from ``collectives.create_ep_dispatcher``'s rule (``capacity_factor`` times the
balanced load; ``None`` takes the worst case, which cannot overflow), or, for sizes with
measured peak loads (``use_measured_peaks``: a runner's saved routing statistics),
``ep_capacity_headroom`` times those peaks
(``ep_config.sized_from_peaks``). The table records the peak loads of every step it sees
(``observe``), so a runner can save them for the next one. Routing is data-dependent,
so the step returns each dispatcher's overflow counts and the host applies
``collectives.resolve_overflow``: under ``"rerun"`` the step runs again with the overflowed
capacity at its next bucket (and later steps of that shape keep the raised capacity, so the
re-run happens once per bucket); under ``"raise"`` a ``CapacityOverflowError`` names the
capacity to raise.
"""

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jtbo.collectives import ep_config, ep_overflow
from jtbo.models import config as config_lib

Dispatchers = tuple[ep_config.EpDispatcher, ...]


class DispatcherTable:
    """The dispatchers the steps of one runner use, keyed by rows per device.

    Holds the raised capacities after a ``"rerun"`` so later steps start from them.
    """

    def __init__(self, mesh: jax.sharding.Mesh, config: config_lib.MoEConfig, parallel):
        """Args: mesh: the ("dp", "attn_tp") mesh; config: the model; parallel: the layout
        (``layer_ops.ParallelConfig``; its ``moe``: EP capacity, exchange, policy, alignment)."""
        self.mesh, self.config, self.parallel = mesh, config, parallel
        # (rows, exchange) -> dispatcher: plain and TBO steps may exchange differently
        self._by_rows: dict[tuple[int, str], ep_config.EpDispatcher] = {}
        self._measured: dict[int, tuple[int, int]] = {}  # rows -> (peer, expert) peaks to size
        self._observed: dict[int, tuple[int, int]] = {}  # rows -> largest peaks seen here

    def use_measured_peaks(self, peaks: Mapping[int, tuple[int, int]]) -> None:
        """Sizes the dispatchers of these row counts on measured peak loads from now on.

        Args:
          peaks: rows per device -> (peer, expert) peak load measured at that size.

        Raises:
          ValueError: a dispatcher of one of these sizes was already built (its compiled
            steps would silently keep the old capacities).
        """
        built = sorted(set(peaks) & {rows for rows, _ in self._by_rows})
        if built:
            raise ValueError(f"dispatchers for rows {built} are already built; load peaks first")
        self._measured.update({int(r): (int(p), int(e)) for r, (p, e) in peaks.items()})

    def observe(self, dispatchers: Dispatchers, peak_load) -> None:
        """Records a step's peak loads (``[..., len(dispatchers), 2]``), max per row count."""
        peaks = step_peaks(dispatchers, peak_load).tolist()
        step = [{d.num_tokens: tuple(p)} for d, p in zip(dispatchers, peaks, strict=True)]
        self._observed = merge_peaks(self._observed, *step)

    def observed_peaks(self) -> dict[int, tuple[int, int]]:
        """Rows per device -> the largest (peer, expert) peak loads ``observe`` has seen."""
        return dict(sorted(self._observed.items()))

    def dispatcher(self, rows: int, tbo: bool = False) -> ep_config.EpDispatcher:
        """The dispatcher for ``rows`` token rows per device in plain or TBO steps (created on
        first use; ``MoEOptions.exchange(tbo)`` is its exchange)."""
        key = (rows, self.parallel.moe.exchange(tbo))
        if key not in self._by_rows:
            self._by_rows[key] = self._create(*key)
        return self._by_rows[key]

    def _create(self, rows: int, exchange: str) -> ep_config.EpDispatcher:
        moe = self.parallel.moe
        factor = moe.ep_capacity_factor
        made = ep_config.create_ep_dispatcher(
            self.mesh,
            num_experts=self.config.num_experts,
            num_tokens=rows,
            top_k=self.config.num_experts_per_tok,
            capacity_factor=1.0 if factor is None else factor,
            worst_case=factor is None,
            exchange=exchange,
            slot_alignment=moe.ep_slot_alignment,
            dedup=moe.ep_dedup,
        )
        if rows not in self._measured:
            return made
        peer, expert = self._measured[rows]
        return ep_config.sized_from_peaks(
            made, peer, expert, headroom=moe.ep_capacity_headroom,
            slot_alignment=moe.ep_slot_alignment,
        )  # fmt: skip

    def for_step(self, capacity: int, child_capacity: int | None) -> Dispatchers:
        """The step's dispatchers: one (no TBO) or one per micro-batch; ``()`` without EP.

        Args:
          capacity: the step's token rows per DP rank.
          child_capacity: TBO child rows, or None without TBO.
        """
        if self.parallel.moe.moe_a2a_backend != "ep":
            return ()
        tp = self.parallel.attn_tp_size
        if child_capacity is None:
            return (self.dispatcher(capacity // tp),)
        child = self.dispatcher(child_capacity // tp, tbo=True)
        return (child, child)

    def resolve(self, dispatchers: Dispatchers, overflow, peak_load=None) -> Dispatchers | None:
        """Applies the overflow policy to a step's counts.

        Args:
          dispatchers: the dispatchers the step ran with (``()``: no EP, nothing to resolve).
          overflow: the step's ``[len(dispatchers), 2]`` (peer, expert) counts.
          peak_load: the step's ``[len(dispatchers), 2]`` (peer, expert) peak loads, or None
            (a re-run then doubles the capacity instead of sizing it on the peak).

        Returns:
          None when the step's result stands; else the dispatchers to re-run it with (also
          remembered for later steps).

        Raises:
          CapacityOverflowError: policy "raise" and something overflowed, or an overflow at a
            worst-case capacity.
        """
        if not dispatchers:
            return None
        counts = np.asarray(overflow)
        if counts.shape[-2:] != (len(dispatchers), 2):
            raise ValueError(
                f"overflow shape {counts.shape} must end in ({len(dispatchers)}, 2) for "
                f"{len(dispatchers)} dispatchers"
            )
        peaks = None if peak_load is None else np.asarray(peak_load)
        resolved = _resolve_each(dispatchers, counts, peaks, self.parallel)
        if all(new is None for new in resolved):
            return None
        for new in resolved:
            if new is not None:
                key = (new.num_tokens, new.exchange)
                self._by_rows[key] = _larger(self._by_rows[key], new)
        # Micro-batches of one shape share a table entry: both re-run with the larger one.
        return tuple(self._by_rows[d.num_tokens, d.exchange] for d in dispatchers)


def step_peaks(dispatchers: Dispatchers, peak_load) -> np.ndarray:
    """``[len(dispatchers), 2]`` (peer, expert) peak loads of a step's ``[..., len, 2]`` ones
    (the max over the leading axes: devices, processes)."""
    return np.asarray(peak_load).reshape(-1, len(dispatchers), 2).max(axis=0)


def merge_peaks(*tables: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """The larger of each (peer, expert) peak over several rows -> peaks tables, by rows."""
    out: dict[int, tuple[int, int]] = {}
    for table in tables:
        for rows, (peer, expert) in table.items():
            old = out.get(rows, (0, 0))
            out[rows] = (max(old[0], int(peer)), max(old[1], int(expert)))
    return dict(sorted(out.items()))


def _resolve_each(dispatchers: Sequence, counts: np.ndarray, peaks, parallel) -> list:
    return [
        ep_overflow.resolve_overflow(
            dispatcher,
            counts[..., index, :],
            policy=parallel.moe.ep_overflow_policy,
            slot_alignment=parallel.moe.ep_slot_alignment,
            peak_load=None if peaks is None else peaks[..., index, :],
        )
        for index, dispatcher in enumerate(dispatchers)
    ]


def _larger(old: ep_config.EpDispatcher, new: ep_config.EpDispatcher) -> ep_config.EpDispatcher:
    """Each capacity at the larger of the two (two micro-batches may raise different ones)."""
    return dataclasses.replace(
        new,
        peer_capacity=max(old.peer_capacity, new.peer_capacity),
        expert_capacity=max(old.expert_capacity, new.expert_capacity),
    )
